"""A small multi-process training run for the distributed and checkpoint tests.

Runs alone or under ``python -m autoshard.runtime.launch``; plans the tiny LM train step of
``autoshard.testing.programs.transformer_train_step`` on the given mesh, trains, and
checkpoints every K steps. Process 0 writes a JSON result (losses by step, the step
indices consumed, the step it resumed from).

    python -m autoshard.runtime.launch -n 2 --devices-per-process 4 -- \
        python tests/integration/distributed_driver.py --mesh 2x4 --steps 10 --out result.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from autoshard.runtime import distributed


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt",
                   help="a zoo model (tiny size) or 'lm' for the plain-JAX LM of the test programs")
    p.add_argument("--mesh", default="2x4")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--batch-for-process", default=None,
                   help="PID=BATCH: another batch size on one process (a mismatched program)")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--restore-step", type=int, default=None)
    p.add_argument("--exit-after-step", type=int, default=None,
                   help="os._exit(3) on process 1 (or the only one) after this step index")
    p.add_argument("--crash-in-save-of-step", type=int, default=None,
                   help="os._exit(17) in the middle of saving this checkpoint step")
    p.add_argument("--dump-state-at", type=int, default=None,
                   help="write the state (host values) to --dump-path after this many steps")
    p.add_argument("--dump-path", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--plan-json", default=None, help="write the plan's JSON here (process 0)")
    p.add_argument("--plan-timeout", type=float, default=30.0)
    return p.parse_args(argv)


def mesh_from(text: str):
    import autoshard
    shape = tuple(int(d) for d in text.split("x"))
    names = ("data", "model")[:len(shape)]
    return autoshard.make_mesh(shape, names)


def make_case(model: str, batch: int):
    """(train_step(state, batch) -> (state, loss), state, make_batch(step))."""
    if model != "lm":
        return zoo_case(model, batch)
    import numpy as np

    from autoshard.testing.programs import transformer_train_step
    program = transformer_train_step(batch=batch)
    fn = program.fn
    params, opt_state, example = program.args
    seq, vocab = example["inputs"].shape[1], 128

    def train_step(state, batch):
        params, opt_state, loss = fn(state["params"], state["opt_state"], batch)
        return {"params": params, "opt_state": opt_state}, loss

    def make_batch(step: int):
        tokens = np.random.default_rng(step).integers(0, vocab, (batch, seq + 1), dtype=np.int32)
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

    return train_step, {"params": params, "opt_state": opt_state}, make_batch


def zoo_case(model: str, batch: int):
    """A tiny zoo model; ``batch`` rows of the zoo's deterministic batch of each step."""
    from autoshard.zoo import models
    case = models.train_case(model, "tiny")

    def make_batch(step: int):
        import jax
        import numpy as np
        full = jax.tree_util.tree_map(np.asarray, case.make_batch(step))
        return jax.tree_util.tree_map(lambda x: x[:batch], full)

    return case.train_step, case.state, make_batch


def crash_in_save_of(step: int) -> None:
    """Exit the process once checkpoint ``step`` is fully written but not yet renamed."""
    from orbax.checkpoint._src.path import atomicity
    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def crashing_finalize(self, *args, **kwargs):
        if self.get_final().name == str(step):
            print(f"crashing while saving checkpoint {step} (written to {self.get().name}, "
                  "not renamed)", flush=True)
            os._exit(17)
        return await finalize(self, *args, **kwargs)

    atomicity.AtomicRenameTemporaryPath.finalize = crashing_finalize


def dump(path: str, state) -> None:
    import jax
    import numpy as np
    host = distributed.to_host(state)
    if distributed.process_info().is_primary:
        flat = {jax.tree_util.keystr(p): np.asarray(x)
                for p, x in jax.tree_util.tree_flatten_with_path(host)[0]}
        np.savez(path, **flat)


def main(argv=None) -> int:
    args = parse_args(argv)
    info = distributed.initialize()
    import jax

    from autoshard.runtime.checkpoint import Checkpointer, abstract_state

    batch = args.batch
    if args.batch_for_process:
        pid, size = (int(v) for v in args.batch_for_process.split("="))
        batch = size if pid == info.process_id else batch
    train_step, state, make_batch = make_case(args.model, batch)
    mesh = mesh_from(args.mesh)
    print(f"process {info.process_id}/{info.num_processes}: {jax.local_device_count()} local of "
          f"{jax.device_count()} devices, mesh {args.mesh}", flush=True)
    plan = distributed.plan_train_step(train_step, state, make_batch(0), mesh=mesh,
                                       donate_argnums=(0,), timeout_s=args.plan_timeout)
    print(f"plan hash {distributed.plan_hash(plan)}", flush=True)
    if args.plan_json and info.is_primary:
        with open(args.plan_json, "w") as f:
            f.write(plan.to_json())
    step_fn = plan.jit()
    state_shardings, batch_shardings = plan.in_shardings

    ckpt = Checkpointer(args.checkpoint_dir) if args.checkpoint_dir else None
    if args.crash_in_save_of_step is not None:
        crash_in_save_of(args.crash_in_save_of_step)
    start, resumed_from = 0, None
    if ckpt is not None and (args.resume or args.restore_step is not None):
        step = args.restore_step if args.restore_step is not None else ckpt.latest_step()
        if step is not None:
            state, record = ckpt.restore(step, abstract_state(state, state_shardings))
            start = resumed_from = record["data_position"]
            print(f"resumed from checkpoint {step} (data position {start})", flush=True)
            if args.dump_state_at == start and args.dump_path:
                dump(args.dump_path, state)
    if resumed_from is None:
        state = distributed.put(state, state_shardings)

    losses, consumed = {}, []
    for step in range(start, args.steps):
        batch_arrays = distributed.put_batch(make_batch(step), batch_shardings)
        consumed.append(step)
        state, loss = step_fn(state, batch_arrays)
        losses[step] = float(distributed.to_host(loss))
        print(f"step {step} loss {losses[step]!r}", flush=True)
        done = step + 1
        if args.dump_state_at == done and args.dump_path and resumed_from is None:
            dump(args.dump_path, state)
        if ckpt is not None and args.checkpoint_every and done % args.checkpoint_every == 0:
            ckpt.save(done, state, data_position=done, plan=plan)
        if args.exit_after_step == step and info.process_id == info.num_processes - 1:
            if ckpt is not None:
                ckpt.wait_until_finished()
            print(f"exiting after step {step}", flush=True)
            os._exit(3)
    if ckpt is not None:
        ckpt.close()
    if args.out and info.is_primary:
        with open(args.out, "w") as f:
            json.dump({"losses": {str(k): v for k, v in losses.items()}, "consumed": consumed,
                       "resumed_from": resumed_from, "plan_hash": distributed.plan_hash(plan),
                       "num_processes": info.num_processes,
                       "device_count": jax.device_count()}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
