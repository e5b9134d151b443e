"""zoo: models with train steps and synthetic data (``models``), and the expert layouts
they are compared against (``experts``).
"""
