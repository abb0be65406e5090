"""Gradients of the same steps under two compile settings, parameter by parameter (GPU, repo root):
  python bench/graph_check.py dump FILE [train_gpt.py flags]   # STEPS steps, default 3; or under torchrun
  python bench/graph_check.py compare A B [C ...]               # each file against A
TRAINER=FILE dumps with that version of train_gpt.py instead of the repository's.
dump builds and warms up the model as train() does, then runs STEPS steps of the first stage on the real-text
stream (--train_files) and saves rank 0's view: each forward's loss and, before each step's optimizers, every
parameter's gradient (float32), the rank's own before the ranks average them. compare prints, per step, each
forward's loss difference and the parameters whose gradients differ most (relative L2: |a - b| / |a|). Two runs of
one setting give the noise floor; a setting that computes something else (a graph that keeps an input from its
recording, a buffer a replay overwrites) differs far above it, and its parameters say where."""
import dataclasses
import importlib.util
import os
import sys

import torch

# TRAINER=other_train_gpt.py dumps with another version of the trainer (e.g. `git show BRANCH:train_gpt.py`)
TRAINER = os.environ.get("TRAINER")
if TRAINER:
    _spec = importlib.util.spec_from_file_location("train_gpt", TRAINER)
    tg = importlib.util.module_from_spec(_spec)
    sys.modules["train_gpt"] = tg
    _spec.loader.exec_module(tg)
else:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import train_gpt as tg
    TRAINER = tg.__file__


def dump(path: str, argv: list[str], steps: int = 3) -> None:
    cfg, _ = tg.parse_cli(argv)
    comm = tg.init_distributed(cfg)
    trainer = tg.build_and_warm_up(cfg, comm, print)
    model, optimizers, schedule = trainer.model, trainer.optimizers, trainer.schedule
    data = tg.train_batches_for_rank(tg.shard_paths(cfg.train_files, "train_files"),
                                     dataclasses.replace(cfg, train_repeat=True), comm)
    batches = tg.prefetch(data, cfg, trainer.device, trainer.per_forward(0))
    names = {p: name for name, p in model.named_parameters()}
    windows, forwards = schedule.windows(0), trainer.forwards(0, comm.world_size)
    records = []
    for _ in range(steps):
        model.prepare_grads()
        losses = []
        for _ in range(forwards):
            loss = tg.forward_loss(model, batches.next(), windows)
            (loss / forwards).backward()
            losses.append(float(loss))
        grads = {names[p]: p.grad.detach().float().cpu() for p in model.parameters() if p.grad is not None}
        records.append({"losses": losses, "grads": grads})
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
    batches.close()
    if comm.is_main:
        torch.save({"argv": argv, "trainer": TRAINER, "world_size": comm.world_size, "steps": records}, path)
        print(f"saved {len(records)} steps of {forwards} forwards (rank 0 of {comm.world_size}) to {path}")
    if comm.distributed:
        torch.distributed.destroy_process_group()


def differences(a: dict, b: dict) -> list[dict]:
    """Per step of two dumps: the forwards' losses (b - a), each parameter's relative gradient difference |b - a| / |a|,
    and the parameters with a gradient in only one of them."""
    steps = []
    for sa, sb in zip(a["steps"], b["steps"]):
        rel = {name: float((sb["grads"][name] - g).norm() / g.norm().clamp(min=1e-30))
               for name, g in sa["grads"].items() if name in sb["grads"]}
        steps.append(dict(losses=sa["losses"], loss_diffs=[y - x for x, y in zip(sa["losses"], sb["losses"])],
                          relative=rel, only_one=sorted(set(sa["grads"]) ^ set(sb["grads"]))))
    return steps


def compare(paths: list[str]) -> None:
    base = torch.load(paths[0])
    print(f"A: {paths[0]} {base.get('trainer')} {' '.join(base['argv'])}")
    for path in paths[1:]:
        other = torch.load(path)
        print(f"\n== {path} against A: {other.get('trainer')} {' '.join(other['argv'])}")
        for index, step in enumerate(differences(base, other)):
            print(f"step {index}: losses A {' '.join(f'{x:.5f}' for x in step['losses'])}; "
                  f"B - A {' '.join(f'{d:+.5f}' for d in step['loss_diffs'])}")
            ranked = sorted(step["relative"].items(), key=lambda item: -item[1])
            median = sorted(step["relative"].values())[len(ranked) // 2]
            print(f"  gradients: median relative difference {median:.2e} over {len(ranked)} parameters; largest:")
            for name, value in ranked[:12]:
                print(f"    {value:.2e}  {name}")
            if step["only_one"]:
                print(f"  with a gradient in only one run: {step['only_one']}")


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "dump":
        dump(sys.argv[2], sys.argv[3:], int(os.environ.get("STEPS", "3")))
    elif len(sys.argv) >= 4 and sys.argv[1] == "compare":
        compare(sys.argv[2:])
    else:
        sys.exit(__doc__)
