"""Streaming DiLoCo on torchft (CPU, gloo): the outer step by hand, two replicas in sync, a replica killed
and restarted. Skipped when torchft is not installed (it is an optional dependency)."""
import contextlib
import dataclasses
import os
import re
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch

import train_gpt as tg
from helpers import TINY, Trainer, free_port, train_scheduled_steps

torchft = pytest.importorskip("torchft", reason="torchft is not installed (pip install torchft): DiLoCo untested")
from torchft.coordination import LighthouseServer  # noqa: E402

SYNC = re.compile(r"^diloco: step (\d+) sync \d+ fragment (\d+) committed replicas (\d+) digest (\S+)$", re.M)
VAL = re.compile(r"^step:(\d+)/\d+ val_loss:(\S+)", re.M)


def tiny_diloco_config(**overrides) -> tg.Config:
    cfg, _ = tg.parse_cli(["--device=cpu", *TINY, "--diloco=1", "--sync_every=4",
                            "--micro_batch_tokens=128"])
    return tg.dataclasses.replace(cfg, **overrides)


@pytest.mark.parametrize("lr", [0.7, 1.0])
def test_outer_step_matches_hand_computation(lr):
    """One replica, two fragments, sync_every=4: fragment 0 syncs after step 2 and fragment 1 after step 4.
    Each becomes old - lr * (old - local): SGD's step on the pseudogradient old - local; the other fragment keeps
    its local weights."""
    cfg = tiny_diloco_config(sync_every=4, num_fragments=2, outer_lr=lr, diloco_replicas=1)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    store = torch.distributed.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = torchft.Manager(pg=torchft.ProcessGroupGloo(), load_state_dict=None, state_dict=None,
                              min_replica_size=1, use_async_quorum=False, replica_id="test_0",
                              store_addr="localhost", store_port=store.port, rank=0, world_size=1,
                              lighthouse_addr=lighthouse.address(), timeout=timedelta(seconds=30))
    try:
        torch.manual_seed(0)
        model = tg.GPT(cfg, tg.SdpaAttention(), torch.float32)
        optimizers = tg.build_optimizers(model, cfg)
        old = {name: p.detach().clone() for name, p in model.named_parameters()}
        local = []  # parameters right after each inner step, before DiLoCo's hook (registered earlier)
        optimizers.register_step_post_hook(
            lambda *_: local.append({name: p.detach().clone() for name, p in model.named_parameters()}))
        logged = []
        run = tg.StreamingDiLoCo(cfg, model, optimizers, torch.device("cpu"), logged.append, manager=manager)
        names = {id(p): name for name, p in model.named_parameters()}
        fragment_names = [{names[id(p)] for p in f.parameters()} for f in run.fragments]
        batches = tg.prefetch(tg.dummy_batches(cfg, seed=1), cfg, torch.device("cpu"), packed=1)
        after = []
        run.__enter__()
        try:
            for _ in range(4):
                tg.train_step(model, optimizers, batches, (32, 64), forwards=1)
                after.append({name: p.detach().clone() for name, p in model.named_parameters()})
        finally:
            batches.close()
            run.close()
    finally:
        lighthouse.shutdown()

    assert len(logged) == 3 and "sync 1 fragment 0 committed" in logged[0] and "sync 2 fragment 1" in logged[1]
    for step, synced in ((1, 0), (3, 1)):
        for name in fragment_names[synced]:
            o, l = old[name].double(), local[step][name].double()
            expected = o - lr * (o - l)
            torch.testing.assert_close(after[step][name].double(), expected, rtol=1e-5, atol=1e-6, msg=name)
        for name in fragment_names[1 - synced]:
            assert torch.equal(after[step][name], local[step][name]), name
    moved = [n for n in fragment_names[0] if not torch.equal(local[1][n], old[n])]
    assert moved  # the inner steps did change the weights, so the check above is not vacuous


def train_replicas_in_threads(cfg, data_seeds, steps, init_sync, on_local=None, before_step=None, timeout=60.0,
                              min_replicas=None, before_start=None):
    """Replicas as threads of this process, as torchft's own tests run them: each with its model (same seed),
    optimizers, manager and StreamingDiLoCo, trained on dummy_batches(cfg, seed) with the schedule set every step
    as the training loop sets it; a replica that heals goes on at the step it healed to, as the loop does.
    on_local(replica, step, named weights) sees each inner step's weights before DiLoCo's hook; before_step(replica,
    step, run) runs before each step; before_start(replica) before a replica joins (makes its manager);
    `timeout` (seconds) bounds each manager's collectives and its process group's; min_replicas (default: all)
    that quorums need. Returns [(final weights, the run)] by replica."""
    min_replicas = min_replicas or len(data_seeds)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=min_replicas)
    replicas = []
    for index, _ in enumerate(data_seeds):
        torch.manual_seed(cfg.seed)
        model = tg.GPT(cfg, tg.SdpaAttention(), torch.float32)
        model.lm_head.weight.data.normal_(std=0.02, generator=torch.Generator().manual_seed(1))
        replicas.append((model, tg.build_optimizers(model, cfg)))
    results = [None] * len(data_seeds)

    def replica_main(index):
        model, optimizers = replicas[index]
        if before_start is not None:
            before_start(index)
        store = torch.distributed.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        manager = torchft.Manager(pg=torchft.ProcessGroupGloo(timeout=timedelta(seconds=timeout)), load_state_dict=None,
                                  state_dict=None, min_replica_size=min_replicas, use_async_quorum=False,
                                  replica_id=f"test_{index}", store_addr="localhost", store_port=store.port,
                                  rank=0, world_size=1, lighthouse_addr=lighthouse.address(),
                                  timeout=timedelta(seconds=timeout), init_sync=init_sync)
        if on_local is not None:  # registered before DiLoCo's hook, so it runs first
            step_of = [0]
            optimizers.register_step_post_hook(lambda *_: on_local(
                index, step_of[0], {name: p.detach().clone() for name, p in model.named_parameters()}))
        run = tg.StreamingDiLoCo(cfg, model, optimizers, torch.device("cpu"), lambda line: None, manager=manager)

        def prepare(step):
            if on_local is not None:
                step_of[0] = step
            if before_step is not None:
                before_step(index, step, run)
            run.step = step + 1
        run.__enter__()
        try:
            train_scheduled_steps(model, optimizers, cfg, steps, seed=data_seeds[index], before_step=prepare,
                                  after_step=lambda step: run.step)  # run.step: step + 1, or the healed step
        finally:
            run.close()
        results[index] = ({name: p.detach().clone() for name, p in model.named_parameters()}, run)

    threads = [threading.Thread(target=replica_main, args=(i,)) for i in range(len(data_seeds))]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
    finally:
        lighthouse.shutdown()
    assert all(r is not None for r in results), "a replica thread failed (its traceback is above)"
    return results


@contextlib.contextmanager
def weights_after_each_sync_hook():
    """{(replica, step): named weights} right after each step's DiLoCo hook, for replicas trained meanwhile by
    train_replicas_in_threads (replica ids test_N)."""
    after = {}
    original_hook = tg.StreamingDiLoCo._after_sync_hook

    def record_after(self, *args):
        original_hook(self, *args)
        replica = int(self.manager._replica_id.split("_")[1].split(":")[0])
        after[replica, self.step - 1] = {name: p.detach().clone() for name, p in self.model.named_parameters()}

    tg.StreamingDiLoCo._after_sync_hook = record_after
    try:
        yield after
    finally:
        tg.StreamingDiLoCo._after_sync_hook = original_hook


def test_replicas_on_the_same_data_train_like_one_replica():
    """Two replicas fed the same micro-batches, one fragment synced after every step, plain averaging
    (outer lr 1): each step's sync gives back the local weights, so both replicas end with
    the weights of one replica trained without DiLoCo. With init_sync replica 1 heals from replica 0 at the first
    quorum, so this also checks that a healed replica follows the lr and momentum schedule (they move within these
    steps: Muon's momentum warms up, the lr changes stage)."""
    cfg = tiny_diloco_config(sync_every=1, num_fragments=1, outer_lr=1.0, num_iterations=8)
    steps = cfg.num_iterations
    torch.manual_seed(cfg.seed)
    model = tg.GPT(cfg, tg.SdpaAttention(), torch.float32)
    model.lm_head.weight.data.normal_(std=0.02, generator=torch.Generator().manual_seed(1))
    train_scheduled_steps(model, tg.build_optimizers(model, cfg), cfg, steps)
    reference = {name: p.detach().clone() for name, p in model.named_parameters()}

    results = train_replicas_in_threads(cfg, data_seeds=(1, 1), steps=steps, init_sync=True)
    assert [run.heals for _, run in results] == [0, 1]
    assert all(run.committed == steps for _, run in results)
    # The outer step's backup - (backup - local) rounds in the last bit. Where a matrix entry's update is near zero
    # that bit can flip Muon's cautious weight decay (decay only where update and weight agree in sign) for one
    # step: lr_eff * muon_weight_decay * lr, about 6e-4 of the weight. So the hidden matrices and the scalars keep
    # within 1e-3 of their scale of one replica's weights (a replica stuck at its step-0 lr and momentum put them
    # 1e-2 or more away); Adam's embedding tables, whose rarely touched rows take normalised steps from tiny
    # gradients, carry the rounding further and are left out. The replicas, which round alike, end bit-equal.
    errors = {}
    for name, expected in reference.items():
        assert torch.equal(results[0][0][name], results[1][0][name]), name
        if "embed" not in name:
            errors[name] = float((results[0][0][name] - expected).abs().max() / expected.abs().max())
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-3, f"{worst}: {errors[worst]:.2e} of its scale from one replica's weights"


def test_a_synced_fragment_is_the_mean_of_the_replicas_local_weights():
    """Two replicas on different data, two fragments, each synced every 4 steps, plain averaging: right after
    its sync a fragment holds the mean of the two replicas' local weights, and the other fragment keeps each
    replica's own. Replicas from the same seed need no heal at step 0 (init_sync off)."""
    cfg = tiny_diloco_config(sync_every=4, num_fragments=2, outer_lr=1.0, num_iterations=8)
    local = {}

    def on_local(replica, step, weights):
        local[replica, step] = weights

    with weights_after_each_sync_hook() as after:
        results = train_replicas_in_threads(cfg, data_seeds=(1, 2), steps=8, init_sync=False, on_local=on_local)
    assert [run.heals for _, run in results] == [0, 0]
    run = results[0][1]
    names = {id(p): name for name, p in run.model.named_parameters()}
    fragment_names = [[names[id(p)] for p in f.parameters()] for f in run.fragments]
    synced_at = {1: 0, 3: 1, 5: 0, 7: 1}  # step (0-based) -> the fragment synced after it
    for step in range(8):
        for fragment, members in enumerate(fragment_names):
            for name in members:
                for replica in (0, 1):
                    got = after[replica, step][name]
                    if synced_at.get(step) == fragment:
                        expected = (local[0, step][name] + local[1, step][name]) / 2
                        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=f"{name} step {step}")
                    else:
                        assert torch.equal(got, local[replica, step][name]), f"{name} step {step}"
    assert not torch.equal(local[0, 7][fragment_names[1][0]], local[1, 7][fragment_names[1][0]])


def test_a_replica_whose_commit_fails_rolls_back_and_heals_at_the_next_sync():
    """A fault on one replica between its all-reduce and its commit vote (torchft's report_error): that replica does
    not commit and takes its fragment's last global weights back, while the other commits. One commit behind, it
    heals from its peer at the next quorum, and after that sync the two hold the same weights again."""
    cfg = tiny_diloco_config(sync_every=2, num_fragments=1, num_iterations=6)

    def fault(replica, step, run):  # replica 1's sync after step 3 fails between its all-reduce and the commit vote
        if replica == 1 and step == 3:
            should_commit = run.manager.should_commit

            def failing(*args, **kwargs):
                run.manager.report_error(RuntimeError("a fault injected by the test"))
                run.manager.should_commit = should_commit
                return should_commit(*args, **kwargs)
            run.manager.should_commit = failing

    with weights_after_each_sync_hook() as after:
        results = train_replicas_in_threads(cfg, data_seeds=(1, 2), steps=6, init_sync=False, before_step=fault)
    runs = [run for _, run in results]
    assert [(run.syncs, run.committed, run.heals) for run in runs] == [(3, 3, 0), (3, 2, 1)]
    same = lambda a, b: all(torch.equal(weight, b[name]) for name, weight in a.items())  # noqa: E731
    assert same(after[0, 1], after[1, 1])
    assert same(after[1, 3], after[1, 1])  # rolled back to the global weights of the sync after step 1
    assert not same(after[0, 3], after[0, 1])  # while replica 0 went on
    assert same(after[0, 5], after[1, 5])  # healed and synced: one model again


def test_an_all_reduce_that_fails_at_a_sync_rolls_both_replicas_back_and_the_next_sync_commits():
    """A fault at a sync: replica 1's all-reduce of the sync after step 3 fails before it reaches the wire (its
    process group raises), so replica 0's all-reduce finds no peer and times out. Neither commits: both take the
    fragment's global weights of the last committed sync back, the same on both, and the next sync, on the same
    fragment (the committed count did not move), commits on both. No replica heals (both stay at one step), and
    both end with one model."""
    cfg = tiny_diloco_config(sync_every=2, num_fragments=1, num_iterations=6)

    def fault(replica, step, run):
        if replica == 1 and step == 3:
            pg = run.manager._pg
            allreduce = pg.allreduce

            def failing(*args, **kwargs):
                pg.allreduce = allreduce
                raise RuntimeError("a fault injected by the test")
            pg.allreduce = failing

    with weights_after_each_sync_hook() as after:
        results = train_replicas_in_threads(cfg, data_seeds=(1, 2), steps=6, init_sync=False, before_step=fault,
                                            timeout=5.0)
    runs = [run for _, run in results]
    assert [(run.syncs, run.committed, run.heals) for run in runs] == [(3, 2, 0), (3, 2, 0)]
    same = lambda a, b: all(torch.equal(weight, b[name]) for name, weight in a.items())  # noqa: E731
    assert same(after[0, 1], after[1, 1])
    for replica in (0, 1):  # rolled back to the global weights of the sync after step 1
        assert same(after[replica, 3], after[replica, 1])
    assert not same(after[0, 4], after[1, 4])  # each trained on its own data since
    assert same(after[0, 5], after[1, 5])  # the retried sync committed: one model again
    assert same(results[0][0], results[1][0])


def test_a_replica_that_joins_late_heals_from_its_peer_and_trains_on_from_its_step():
    """Replica 0 trains alone (quorums of one) until its step 4; only then does replica 1 join. At its first quorum it
    is behind, so it heals: it takes replica 0's weights, optimizer state and step, and goes on from that step, not
    from its own; from then on every sync has both replicas and commits, and the two end with one model."""
    cfg = tiny_diloco_config(sync_every=2, num_fragments=1, num_iterations=12, outer_lr=1.0)
    joined, running = threading.Event(), threading.Event()
    trained = {0: [], 1: []}

    def before_start(replica):
        if replica == 1:
            assert joined.wait(timeout=120)

    def before_step(replica, step, run):
        trained[replica].append(step)
        if replica == 0 and step == 4:
            joined.set()
        if replica == 0 and step == 6:  # not done before replica 1 is up (its manager beating): its syncs wait for it
            assert running.wait(timeout=120)
        if replica == 1 and step == 1:
            running.set()

    with weights_after_each_sync_hook() as after:
        results = train_replicas_in_threads(cfg, data_seeds=(1, 2), steps=12, init_sync=False, before_step=before_step,
                                            min_replicas=1, before_start=before_start)
    runs = [run for _, run in results]
    assert [run.heals for run in runs] == [0, 1]
    assert trained[0] == list(range(12))
    healed_to = trained[1][2]  # its steps 0 and 1, then the sync after step 1 heals it
    assert trained[1] == [0, 1] + list(range(healed_to, 12)) and healed_to > 4
    for step in range(healed_to + 1, 12, 2):  # every sync after the heal: one model
        assert all(torch.equal(w, after[1, step][name]) for name, w in after[0, step].items()), step
    assert all(torch.equal(w, results[1][0][name]) for name, w in results[0][0].items())
    assert runs[1].manager.num_participants() == 2


def test_diloco_flags_are_checked():
    for flags, message in (
        (["--sync_every=6", "--num_fragments=4"], "--num_fragments=4 --sync_every=6: 1 .. num_layers fragments"),
        (["--sync_every=8", "--num_iterations=20"],
         "--num_iterations + --extension_steps = 20 must be a multiple of --sync_every=8"),
        (["--sync_every=4", "--replica=2", "--diloco_replicas=2"], "a replica 0 .. diloco_replicas-1"),
        (["--sync_every=4", "--outer_lr=0"], "--outer_lr=0.0: use 1e-06 .. 9"),
        (["--sync_every=4", "--adam_period=2"], "--adam_period=2: DiLoCo needs 1"),
        (["--sync_every=4", "--num_fragments=2", "--checkpoint_every=3", "--save_checkpoint=x.pt"],
         "--checkpoint_every=3: with --diloco=1 a multiple of sync_every/num_fragments"),
    ):
        with pytest.raises(tg.UserError, match=re.escape(message)):
            tg.parse_cli(["--preset=tiny", "--diloco=1", *flags])


def test_missing_lighthouse_is_one_clear_error_before_compiling(tiny_data, monkeypatch, capsys):
    train, val = tiny_data
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    code = tg.main(["--device=cpu", *TINY, "--diloco=1", "--sync_every=4", f"--train_files={train}",
                    f"--val_files={val}"])
    assert code == 1 and capsys.readouterr().err.strip() == f"error: {tg.LIGHTHOUSE_MISSING}"


def test_unreachable_lighthouse_is_one_clear_error(monkeypatch):
    store = torch.distributed.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    for name, value in (("TORCHFT_LIGHTHOUSE", "http://localhost:1"), ("TORCHFT_CONNECT_TIMEOUT_SEC", "2"),
                        ("MASTER_ADDR", "localhost"), ("MASTER_PORT", str(store.port)), ("RANK", "0"),
                        ("WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)  # nothing listens on port 1
    cfg = tiny_diloco_config()
    model = tg.GPT(cfg, tg.SdpaAttention(), torch.float32)
    with pytest.raises(tg.UserError, match=r"no torchft lighthouse answered at TORCHFT_LIGHTHOUSE=http://localhost:1 "):
        tg.StreamingDiLoCo(cfg, model, tg.build_optimizers(model, cfg), torch.device("cpu"), print)


@pytest.mark.parametrize("copy_pointer", [False, True])
def test_diloco_fragments_cover_the_model_once(copy_pointer):
    cfg = dataclasses.replace(tiny_diloco_config(), copy_pointer=copy_pointer, longest_match=copy_pointer)
    model = tg.GPT(cfg, tg.SdpaAttention(), torch.float32)
    fragments = tg.diloco_fragments(model, 3)
    ids = [id(p) for f in fragments for p in f.parameters()]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    assert any(p is model.embed.weight for p in fragments[0].parameters())
    assert any(p is model.lm_head.weight for p in fragments[-1].parameters())
    if copy_pointer:
        assert any(p is model.copy_pointer.sink for p in fragments[-1].parameters())
        assert any(p is model.longest_match.scale for p in fragments[0].parameters())


def start_replica(tmp_path, data, lighthouse, replica: int, run_id: str, *extra) -> Trainer:
    """A replica group of one process, forked from the preloaded server and leading a process group of its own:
    torchrun's worker with what torchrun would give it (rank, world size, the store's address) but without torchrun's
    agent and the seconds of imports a new Python spends."""
    train, val = data
    env = dict(TORCHFT_LIGHTHOUSE=lighthouse.address(), OMP_NUM_THREADS="1", RANK="0", LOCAL_RANK="0",
               WORLD_SIZE="1", MASTER_ADDR="localhost", MASTER_PORT=str(free_port()))
    args = ["--device=cpu", *TINY, f"--train_files={train}", f"--val_files={val}", "--micro_batch_tokens=128",
            "--diloco=1", f"--replica={replica}", "--sync_every=4", "--num_fragments=2", *extra]  # later flags win
    return Trainer(run_id, args, tmp_path, env)


def test_two_replicas_stay_in_sync_and_learn(tiny_data, tmp_path):
    """Heterogeneous replicas: replica 1 takes twice the inner steps between syncs (a faster machine), so
    it runs twice the steps; both do 8 fragment syncs, in the same order, with the same weights."""
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:  # with 2 fragments, replica 0 syncs one after every step, replica 1 after every second step
        procs = [start_replica(tmp_path, tiny_data, lighthouse, 0, "replica0", "--num_iterations=8",
                               "--val_loss_every=8", "--sync_every=2"),
                 start_replica(tmp_path, tiny_data, lighthouse, 1, "replica1", "--num_iterations=16",
                               "--val_loss_every=16", "--sync_every=4")]
        logs = [p.log() for p in procs]
    finally:
        lighthouse.shutdown()
    syncs = [SYNC.findall(log) for log in logs]
    assert len(syncs[0]) == len(syncs[1]) == 8
    assert [s[1:] for s in syncs[0]] == [s[1:] for s in syncs[1]]  # fragment, replicas, digest at every sync
    assert [int(s[0]) for s in syncs[1]] == [2 * int(s[0]) for s in syncs[0]]
    assert all(replicas == "2" for _, _, replicas, _ in syncs[0])
    # the final syncs leave both with one model, whose validation loss they both report
    finals = [re.findall(r"^final weights: .*$", log, re.M) for log in logs]
    assert len(finals[0]) == 1 and finals[0] == finals[1]
    assert all(len(re.findall(r"^diloco: final sync of fragment 0 committed replicas 2$", log, re.M)) == 1 for log in logs)
    assert VAL.findall(logs[0])[-1][1] == VAL.findall(logs[1])[-1][1]
    for log, steps in zip(logs, (8, 16)):
        losses = {int(step): float(loss) for step, loss in VAL.findall(log)}
        assert losses[steps] < losses[0] - 1.0
        assert re.search(r"^diloco: 9 fragment syncs \(9 committed\), 0 heals$", log, re.M)  # same seed: no heal


def test_killed_replica_rejoins_with_the_weights_of_its_peer(tiny_data, tmp_path):
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=20000, heartbeat_timeout_ms=1000)
    # Replica 1 is killed after its second sync and restarted once the survivor has synced alone; a restart takes a
    # few steps (the server's fork spares it the imports), so 32 steps leave syncs of the two together at the end.
    flags = ("--num_iterations=32", "--val_loss_every=0", "--train_repeat=1")

    def wait_for(log, count, pattern, proc, what):
        deadline = time.time() + 300
        while not (log.exists() and len(pattern.findall(log.read_text())) >= count):
            assert time.time() < deadline and proc.poll() is None, what
            time.sleep(0.1)

    try:
        survivor = start_replica(tmp_path, tiny_data, lighthouse, 0, "survivor", *flags)
        doomed = start_replica(tmp_path, tiny_data, lighthouse, 1, "doomed", *flags)
        wait_for(tmp_path / "logs" / "doomed.txt", 2, SYNC, doomed, "replica 1 never reached its second sync")
        os.killpg(doomed.pid, signal.SIGKILL)  # its process group: the replica and anything it started
        doomed.wait()
        alone = re.compile(r"^diloco: step \d+ sync \d+ fragment \d+ committed replicas 1 ", re.M)
        wait_for(tmp_path / "logs" / "survivor.txt", 1, alone, survivor, "the survivor never synced alone")
        restarted = start_replica(tmp_path, tiny_data, lighthouse, 1, "restarted", *flags)
        logs = {"survivor": survivor.log(), "restarted": restarted.log()}
    finally:
        lighthouse.shutdown()
    assert "step:32/32 val_loss" in logs["survivor"]
    recovered = re.search(r"^diloco: recovered weights and optimizer state from a peer; step \d+ -> (\d+); "
                          r"the data goes on from this rank's micro-batch (\d+)$", logs["restarted"], re.M)
    assert recovered and int(recovered.group(1)) > 4
    # it reads on from where its own share of the data is at that step, not from the start
    schedule = tg.Schedule(tg.parse_cli(["--device=cpu", *TINY, *flags])[0])
    assert int(recovered.group(2)) == schedule.micro_batches_before(int(recovered.group(1))) > 0
    survivor_syncs = {(step, fragment): digest for step, fragment, _, digest in SYNC.findall(logs["survivor"])}
    rejoined = [(step, fragment, digest) for step, fragment, replicas, digest in SYNC.findall(logs["restarted"])
                if replicas == "2"]
    assert rejoined, "the restarted replica never synced together with the survivor"
    for step, fragment, digest in rejoined:
        assert survivor_syncs[(step, fragment)] == digest


def test_replicas_resumed_from_their_checkpoints_train_as_if_never_stopped(tiny_data, tmp_path):
    """Two replicas run 8 steps, writing checkpoints every 2; two more resume from those of step 2 (one committed
    sync: fragment 1 is next) and run to 8. The resumed pair takes the same fragments in the same order with the
    same weights (no heal: they restore the committed syncs, the global weights and the outer state), and
    ends with the same model."""
    flags = ("--num_iterations=8", "--val_loss_every=8", "--checkpoint_every=2")

    def run_pair(name, *extra):
        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
        try:
            procs = [start_replica(tmp_path, tiny_data, lighthouse, r, f"{name}{r}", *flags,
                                   f"--save_checkpoint={tmp_path / name / str(r) / 'final.pt'}",
                                   *[flag.format(r=r) for flag in extra]) for r in (0, 1)]
            return [p.log() for p in procs]
        finally:
            lighthouse.shutdown()

    whole = run_pair("whole")
    resumed = run_pair("resumed", f"--resume={tmp_path / 'whole' / '{r}' / 'final_step000002.pt'}")
    for r in (0, 1):
        assert re.search(r"^resumed from .* at step 2$", resumed[r], re.M)
        assert not re.search(r"^diloco: recovered", resumed[r], re.M)
        later = [sync for sync in SYNC.findall(whole[r]) if int(sync[0]) > 2]
        assert len(later) == 3 and SYNC.findall(resumed[r]) == later
        assert VAL.findall(resumed[r])[-1] == VAL.findall(whole[r])[-1]
        assert re.findall(r"^final weights: .*$", resumed[r], re.M) == re.findall(r"^final weights: .*$", whole[r], re.M)
