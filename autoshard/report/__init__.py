"""report: plans judged and shown. Compiled programs read (``hlo_report``), views for a
terminal, a notebook or a figure (``viz``), and the plan against expert layouts
(``judge``).
"""
