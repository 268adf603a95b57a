"""Seeds as one batched computation (rwinterp.training.train_seeds, rwinterp train --seeds): every seed's
trajectory equals training that seed alone."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
import warnings

import pytest
import torch

from rwinterp.bridge import build_bridge
from rwinterp.cli import main
from rwinterp.config import BridgeOptions, TrainConfig, parse_seeds
from rwinterp.errors import RwinterpError
from rwinterp.model import DeepConfig, DeepTransformer
from rwinterp.runs import load_group, load_run, read_group
from rwinterp.stack import ModelStack
from rwinterp.tasks import CircleWalk, task_from_dict
from rwinterp.training import (
    TrainingDiverged, check_memory, choose_threads, make_data, resolve_device, running_elsewhere, train, train_seeds,
)
from tests.conftest import assert_close

SEEDS = (0, 3, 7)


def build(kind: str, options: dict, seed: int) -> torch.nn.Module:
    if kind == "bridge":
        return build_bridge(BridgeOptions(**{**options, "seed": seed}))
    return DeepTransformer(DeepConfig(**{**options, "seed": seed}))


PAPER = dict(n_states=5, n_ctx=9, pos_dim=16)
GAUSSIAN = dict(PAPER, init="gaussian", init_sigma=0.05)
DEEP = dict(n_states=4, n_ctx=7, pos_dim=12, init="gaussian", init_sigma=0.1)
BRIDGE = dict(n_states=4, n_ctx=7, d_model=8, dtype="float64")
NEXT = dict(loss="xent", next_token=True)

# (model kind, model options, training options, task): every model kind and optimiser, weight decay,
# population mode, mini-batches, fresh batches and the cosine schedule.
CASES = {
    "paper gd": ("deep", PAPER, dict(steps=10), None),
    "paper deterministic walk": ("deep", dict(PAPER, n_states=7), dict(steps=20), {"kind": "circle", "K": 7, "p": 1.0,
                                                                                  "N": 9}),
    "paper population": ("deep", PAPER, dict(steps=10, population=True), None),
    "paper gd weight decay": ("deep", GAUSSIAN, dict(steps=10, weight_decay=0.1), None),
    "paper adamw": ("deep", GAUSSIAN, dict(steps=10, optimizer="adamw", lr=0.01, weight_decay=0.1), None),
    "paper adamw cosine": ("deep", GAUSSIAN, dict(steps=10, optimizer="adamw", lr=0.01, weight_decay=0.1,
                                                 lr_schedule="cosine"), None),
    "paper sgd": ("deep", GAUSSIAN, dict(steps=10, optimizer="sgd", batch_size=50, n_train=200, eval_every=3), None),
    "paper sgd normalised": ("deep", dict(GAUSSIAN, normalize_tokens=True),
                             dict(steps=10, optimizer="sgd", batch_size=50, n_train=200, eval_every=3), None),
    "paper FC layer": ("deep", dict(PAPER, init="gaussian", init_sigma=0.1, mlp_width=4), dict(steps=10, loss="xent"),
                       None),
    "deep 2 layers 2 heads": ("deep", dict(DEEP, n_layers=2, n_heads=2), dict(steps=8, loss="xent"), None),
    "deep full W adamw": ("deep", dict(DEEP, rank_one_query=False, normalize_tokens=True),
                          dict(steps=8, optimizer="adamw", lr=0.01, weight_decay=0.1, loss="xent"), None),
    "deep full W population": ("deep", dict(PAPER, n_states=4, n_ctx=7, pos_dim=12, rank_one_query=False),
                               dict(steps=8, population=True, optimizer="adamw", lr=0.05), None),
    "deep standard": ("deep", DeepConfig.standard(4, 7, 16).to_dict(), dict(NEXT, steps=8, optimizer="adamw", lr=0.01),
                      None),
    "deep residual FC sgd": ("deep", dict(DEEP, n_layers=2, mlp_width=5, readout="learned", residual=True),
                             dict(steps=6, loss="xent", optimizer="sgd", batch_size=50, n_train=200), None),
    "bridge gd": ("bridge", dict(BRIDGE, n_layers=1), dict(NEXT, steps=6, lr=0.5), None),
    "bridge adamw": ("bridge", dict(BRIDGE, n_layers=2), dict(NEXT, steps=8, optimizer="adamw", lr=0.01,
                                                            weight_decay=0.01), None),
    "bridge LayerNorm MLP sgd": ("bridge", dict(BRIDGE, n_layers=1, norm="LN", attn_only=False),
                                 dict(NEXT, steps=6, optimizer="sgd", batch_size=40, lr=0.1), None),
    "icl fresh batches": ("deep", dict(n_states=3, n_ctx=12, pos_dim=16, n_layers=2, init="gaussian", init_sigma=0.1,
                                       attention="causal"),
                          dict(NEXT, steps=6, optimizer="sgd", batch_size=30, n_train=60), {"kind": "icl", "K": 3,
                                                                                             "N": 12}),
}


def _task(options: dict, task: dict | None):
    return task_from_dict(task) if task else CircleWalk(options["n_states"], 0.7, options["n_ctx"])


def _assert_same_history(batched: list[dict], alone: list[dict]) -> None:
    """Every recorded number equal to 1e-10 relative (accuracies, shares of 1000 walks, exactly)."""
    assert [r["step"] for r in batched] == [r["step"] for r in alone]
    for got, want in zip(batched, alone):
        assert set(got) == set(want)
        for key in want:
            if want[key] is None:  # (v_distance while V = 0)
                assert got[key] is None, key
                continue
            a, b = torch.tensor(got[key], dtype=torch.float64), torch.tensor(want[key], dtype=torch.float64)
            if key.endswith("accuracy"):
                assert torch.equal(a, b), key
            else:
                torch.testing.assert_close(a, b, rtol=1e-10, atol=0, msg=key)


def _assert_same_weights(batched: torch.nn.Module, alone: torch.nn.Module) -> None:
    """Every weight equal to 1e-10 relative to the model's largest weight. (Relative to the model, not to each
    entry: a bridge's key bias has a gradient of exactly zero in exact arithmetic, since a softmax ignores a
    shift of all its scores, so its entries are round-off of order 1e-19 that differs with the order of any
    sum.)"""
    got, want = batched.state_dict(), alone.state_dict()
    assert list(got) == list(want)
    scale = max(float(t.abs().max()) for t in want.values() if t.is_floating_point() and t.numel())
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-10 * scale, msg=name)


@pytest.mark.parametrize("case", list(CASES))
def test_each_seed_trains_as_it_would_alone(case):
    kind, options, train_options, task_dict = CASES[case]
    task = _task(options, task_dict)
    configs = [TrainConfig(**train_options, seed=seed) for seed in SEEDS]
    alone = []
    for seed, config in zip(SEEDS, configs):
        model = build(kind, options, seed)
        alone.append((model, train(model, task, config, progress=False)))
    models = [build(kind, options, seed) for seed in SEEDS]
    with warnings.catch_warnings():
        # (the fused attention kernel has no batching rule: it runs per seed, which torch would warn about)
        warnings.filterwarnings("error", message=".*batching rule")
        results = train_seeds(models, task, configs, progress=False)
    for model, result, (solo, solo_result) in zip(models, results, alone):
        assert result.diverged is None
        _assert_same_history(result.history, solo_result.history)
        _assert_same_weights(model, solo)
        assert not model.training
    # The seeds differ (their data, and their initialisation where it is random): the batch is no copy of one.
    # (In population mode every seed trains on the same exact expectation: from zero init they coincide.)
    if not train_options.get("population"):
        assert results[0].history[-1]["loss"] != results[1].history[-1]["loss"]


def test_the_deterministic_walk_keeps_exact_symmetry_in_a_batch():
    """Theorem 4.1 for each seed of a batch: with p = 1 every row of V stays constant and the attention over
    the observed tokens uniform, bit for bit (the sums that keep it so run alike in the stack)."""
    K, N = 7, 29
    task = CircleWalk(K, 1.0, N)
    models = [build("deep", dict(n_states=K, n_ctx=N, pos_dim=64), seed) for seed in SEEDS]
    train_seeds(models, task, [TrainConfig(steps=30, n_train=300, n_test=300, seed=s) for s in SEEDS], progress=False)
    for model in models:
        V = model.V.detach()
        assert torch.equal(V, V[:, :1].expand_as(V))
        pattern = model.attention(task.sample(20, 1).tokens).detach()[:, 0, 0, : N - 1]
        assert torch.equal(pattern, pattern[:, :1].expand_as(pattern))


def test_models_hold_their_own_weights_after_training():
    """After the batch the models' weights are no longer views of one stack: changing one leaves the others."""
    task = CircleWalk(5, 0.7, 9)
    models = [build("deep", GAUSSIAN, seed) for seed in SEEDS]
    train_seeds(models, task, [TrainConfig(steps=2, seed=s) for s in SEEDS], progress=False)
    before = models[1].u.detach().clone()
    with torch.no_grad():
        models[0].u.zero_()
    assert torch.equal(models[1].u.detach(), before)
    assert models[0].u.untyped_storage().data_ptr() != models[1].u.untyped_storage().data_ptr()


def test_callbacks_and_checkpoints_are_each_seeds():
    task = CircleWalk(5, 0.7, 9)
    configs = [TrainConfig(steps=4, eval_every=2, checkpoint_every=2, seed=s) for s in SEEDS]
    seen: dict[int, list] = {}
    models = [build("deep", GAUSSIAN, seed) for seed in SEEDS]

    def callback(step, model, record):
        seen.setdefault(models.index(model), []).append((step, record, model.u.detach().clone()))

    results = train_seeds(models, task, configs, progress=False, callback=callback)
    for i, (seed, config) in enumerate(zip(SEEDS, configs)):
        alone = build("deep", GAUSSIAN, seed)
        steps = []
        solo = train(alone, task, config, progress=False,
                     callback=lambda step, model, record: steps.append((step, record, model.u.detach().clone())))
        assert [s for s, _, _ in seen[i]] == [0, 2, 4] == [s for s, _, _ in steps]
        assert [r for _, r, _ in seen[i]] == results[i].history
        for (_, _, u), (_, _, solo_u) in zip(seen[i], steps):
            assert_close(u, solo_u)
        assert [s for s, _ in results[i].checkpoints] == [s for s, _ in solo.checkpoints] == [0, 2, 4]
        for (_, state), (_, solo_state) in zip(results[i].checkpoints, solo.checkpoints):
            for name in solo_state:
                assert_close(state[name], solo_state[name], what=name)


def test_a_seed_that_diverges_stops_alone():
    """Seed 2's Gaussian initialisation leaves a score below -eps (the loss -log(f_y + eps) undefined): it stops
    at initialisation with train's message while the other seeds train on, each as it would alone."""
    task = CircleWalk(5, 0.7, 9)
    options = dict(PAPER, init="gaussian", init_sigma=0.1)
    seeds = [0, 1, 2, 3]
    configs = [TrainConfig(steps=6, n_train=50, n_test=50, seed=s) for s in seeds]
    models = [build("deep", options, seed) for seed in seeds]
    initial = models[2].u.detach().clone()
    results = train_seeds(models, task, configs, progress=False)
    for seed, model, result, config in zip(seeds, models, results, configs):
        alone = build("deep", options, seed)
        if seed == 2:
            with pytest.raises(TrainingDiverged) as caught:
                train(alone, task, config, progress=False)
            assert result.diverged == str(caught.value) and "at initialisation" in result.diverged
            assert result.history == caught.value.result.history == []
            assert torch.equal(model.u.detach(), initial)
        else:
            solo = train(alone, task, config, progress=False)
            assert result.diverged is None
            _assert_same_history(result.history, solo.history)
            _assert_same_weights(model, alone)


def test_the_paper_model_computes_its_stack_without_vmap(monkeypatch):
    """The paper's model runs a stack as it is (``computes_stacks``): no ``vmap``, and every number bit-equal to
    training each seed alone. With a hook on its output stream it no longer does, and the stack goes through
    ``vmap``."""
    task, options = CircleWalk(5, 0.7, 9), dict(PAPER, init="gaussian", init_sigma=0.05)
    configs = [TrainConfig(steps=6, n_train=50, n_test=50, seed=s) for s in SEEDS]
    mapped = []
    vmap = torch.func.vmap
    monkeypatch.setattr(torch.func, "vmap", lambda *a, **k: mapped.append(1) or vmap(*a, **k))
    models = [build("deep", options, s) for s in SEEDS]
    results = train_seeds(models, task, configs, progress=False)
    assert mapped == []
    for seed, config, model, result in zip(SEEDS, configs, models, results):
        alone = build("deep", options, seed)
        assert result.history == train(alone, task, config, progress=False).history
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), alone.state_dict().values()))
    hooked = [build("deep", options, s) for s in SEEDS]
    hooked[0].blocks[0].hook_resid_post.add_hook(lambda x, hook: x)
    assert not hooked[0].computes_stacks()
    again = train_seeds(hooked, task, configs, progress=False)
    assert mapped and [r.history for r in again] == [r.history for r in results]


@pytest.mark.parametrize("seed", [0, 2])
def test_a_batch_of_one_trains_as_train_does(seed):
    """One model is trained as ``train`` trains it (no stack): the same numbers to the last bit; and where it
    diverges (seed 2, see above) the result says so instead of raising."""
    task, options = CircleWalk(5, 0.7, 9), dict(PAPER, init="gaussian", init_sigma=0.1)
    config = TrainConfig(steps=6, n_train=50, n_test=50, seed=seed)
    model, alone = build("deep", options, seed), build("deep", options, seed)
    [result] = train_seeds([model], task, [config], progress=False)
    if seed == 2:
        with pytest.raises(TrainingDiverged) as caught:
            train(alone, task, config, progress=False)
        assert result.diverged == str(caught.value)
        return
    solo = train(alone, task, config, progress=False)
    assert result.diverged is None and result.history == solo.history
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), alone.state_dict().values()))


@pytest.mark.parametrize("eval_every", [1, 2])
def test_when_every_seed_diverges_each_keeps_its_last_good_state(eval_every):
    """lr 1e200 on the squared loss: every seed's loss overflows after its first step, found on an evaluated
    step (each keeps its initial state) or on a mini-batch step that is not evaluated (each keeps the state
    whose mini-batch loss overflowed), as :func:`train` keeps it."""
    task = CircleWalk(4, 0.7, 9)
    config = dict(lr=1e200, loss="squared", steps=3, optimizer="sgd", batch_size=20, n_train=40,
                  eval_every=eval_every)
    models = [build("deep", dict(PAPER, n_states=4), seed) for seed in SEEDS]
    results = train_seeds(models, task, [TrainConfig(**config, seed=s) for s in SEEDS], progress=False)
    for seed, model, result in zip(SEEDS, models, results):
        alone = build("deep", dict(PAPER, n_states=4), seed)
        with pytest.raises(TrainingDiverged) as caught:
            train(alone, task, TrainConfig(**config, seed=seed), progress=False)
        assert result.diverged == str(caught.value)
        assert result.history == caught.value.result.history
        _assert_same_weights(model, alone)
        assert (torch.count_nonzero(model.V) == 0) == (eval_every == 1)
        assert not model.training


@pytest.mark.parametrize("change, message", [
    (lambda models, configs: (models, [configs[0], configs[1].replace(lr=0.5), configs[2]]), "config 1 differs"),
    (lambda models, configs: ([models[0], build("deep", dict(PAPER, pos_dim=20), 3), models[2]], configs),
     "model 1 differs"),
    (lambda models, configs: (models[:2], configs), "3 training configs"),
    (lambda models, configs: ([models[0], models[0], models[2]], configs), "appears twice"),
])
def test_a_batch_trains_one_configuration(change, message):
    task = CircleWalk(5, 0.7, 9)
    models = [build("deep", PAPER, seed) for seed in SEEDS]
    configs = [TrainConfig(steps=2, seed=s) for s in SEEDS]
    models, configs = change(models, configs)
    with pytest.raises(RwinterpError, match=message):
        train_seeds(models, task, configs, progress=False)


def test_given_data_with_an_invalid_token_is_refused_before_the_batch():
    task = CircleWalk(5, 0.7, 9)
    models = [build("deep", PAPER, seed) for seed in SEEDS]
    configs = [TrainConfig(steps=2, seed=s) for s in SEEDS]
    data = [make_data(task, config) for config in configs]
    data[1][0].tokens[0, 0] = 9
    with pytest.raises(RwinterpError, match=r"tokens must lie in \[0, 5\]"):
        train_seeds(models, task, configs, data=data, progress=False)
    # one model alone: its given test data are checked once, before the first step, as the batch's are
    data[1][1].tokens[0, 0] = -1
    with pytest.raises(RwinterpError, match=r"tokens must lie in \[0, 5\], got \[-1, 5\]"):
        train(models[0], task, configs[0], data=(data[0][0], data[1][1]), progress=False)


def test_a_stack_maps_a_bridge_whose_modules_share_parameters():
    """A TransformerLens bridge holds each attention weight under four names; the stack swaps every one of them
    and gives them back after each pass (the outputs and the models are unchanged by it)."""
    models = [build("bridge", dict(BRIDGE, n_layers=1), seed) for seed in SEEDS]
    tokens = torch.randint(0, 4, (len(SEEDS), 5, 7))
    alone = [model(tokens[i]) for i, model in enumerate(models)]
    stack = ModelStack(models)
    out = stack.map(lambda model, t: model(t), tokens, in_dims=(0,))
    for i, model in enumerate(models):
        assert_close(out[i], alone[i], rtol=1e-12)
        torch.testing.assert_close(model(tokens[i]), alone[i], rtol=0, atol=0)  # the model itself, after the pass


# ---------------------------------------------------------------------------------------- the command line
SMALL = ["--K", "4", "--N", "9", "--M", "16", "--steps", "4", "--n-train", "60", "--n-test", "60", "--no-progress"]


def test_train_seeds_writes_a_group_of_runs_each_as_its_seed_alone(tmp_path, capsys):
    out = tmp_path / "group"
    assert main(["train", *SMALL, "--seeds", "0-1,5", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "3 seeds in one batch" in printed and "saved group" in printed
    index = read_group(out)
    assert index["seeds"] == [0, 1, 5] and "seed" not in index["model"] and "seed" not in index["train"]
    assert sorted(p.name for p in out.iterdir()) == ["group.json", "seed-0", "seed-1", "seed-5"]
    runs = load_group(out)
    for seed, entry, run in zip([0, 1, 5], index["runs"], runs):
        assert main(["train", *SMALL, "--seed", str(seed), "--out", str(tmp_path / f"alone-{seed}")]) == 0
        capsys.readouterr()
        alone = load_run(tmp_path / f"alone-{seed}")
        assert run.train == alone.train and run.train["seed"] == seed
        assert run.model.cfg.seed == seed
        _assert_same_history(run.history, alone.history)
        _assert_same_weights(run.model, alone.model)
        assert entry["seed"] == seed and entry["summary"]["test_accuracy"] == run.summary["test_accuracy"]


def test_train_seeds_json(capsys):
    assert main(["train", *SMALL, "--seeds", "2,4", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["seeds"] == [2, 4] and [r["seed"] for r in printed["runs"]] == [2, 4]
    assert all(len(r["history"]) == 5 and r["error"] is None for r in printed["runs"])


@pytest.mark.parametrize("seeds, message", [
    ("5-2", "--seeds 5-2: a range runs from its lower seed to its higher one (2-5)"),
    ("", "--seeds is empty"),
    ("0-3,x", "--seeds must list seeds (0,3,7) or ranges of them (0-19), got '0-3,x'"),
    ("1-", "--seeds must list seeds"),
    ("0,2,2", "--seeds lists seed 2 twice"),
    ("0-4,3", "--seeds lists seed 3 twice"),
])
def test_bad_seeds_are_one_line_errors_and_nothing_is_written(tmp_path, capsys, seeds, message):
    assert main(["train", *SMALL, "--seeds", seeds, "--out", str(tmp_path / "g")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not (tmp_path / "g").exists()


def test_seed_and_seeds_do_not_go_together(capsys):
    assert main(["train", *SMALL, "--seeds", "0-2", "--seed", "1"]) == 2
    assert "--seed and --seeds do not go together" in capsys.readouterr().err


def test_a_diverging_seed_is_reported_and_the_others_saved(tmp_path, capsys):
    out = tmp_path / "g"
    args = ["--K", "5", "--p", "0.7", "--N", "9", "--M", "16", "--steps", "3", "--n-train", "50", "--n-test", "50",
            "--init", "gaussian", "--sigma", "0.1", "--no-progress"]
    assert main(["train", *args, "--seeds", "1-3", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("rwinterp: error: seed 2: the loss -log(f_y + eps) is undefined at initialisation")
    index = read_group(out)
    assert [e["run"] for e in index["runs"]] == ["seed-1", None, "seed-3"]
    assert "undefined at initialisation" in index["runs"][1]["error"]
    assert len(load_group(out)) == 2


def test_parse_seeds_keeps_the_order_given():
    assert parse_seeds("7,3,0-1") == [7, 3, 0, 1]
    with pytest.raises(RwinterpError, match="every seed of --seeds must be an integer"):
        parse_seeds(str(2**63))


# ---------------------------------------------------------------------------------------- threads, memory, devices
def test_threads_count_every_seed_of_a_batch(monkeypatch):
    """One thread for the Fig 4 step of one model; a batch of 20 is no longer small and takes the cores that other
    processes leave free: the load average counts this process's own recent work, the threads running elsewhere
    do not."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(4)))
    monkeypatch.setattr("os.getloadavg", lambda: (1.0, 1.0, 1.0))
    options, task, config = DeepConfig.paper(6, 97, 1000), CircleWalk(6, 0.5, 97), TrainConfig()
    for elsewhere, threads in [(1, 3), (0, 4), (None, 3), (3, 3)]:
        monkeypatch.setattr("rwinterp.training.running_elsewhere", lambda: elsewhere)
        assert choose_threads(options, task, config) == 1
        assert choose_threads(options, task, config, copies=20) == threads


def test_a_busy_neighbour_is_seen_running():
    """A process spinning on another core is seen as a thread running elsewhere."""
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert running_elsewhere(looks=20) >= 1
    finally:
        child.kill()
        child.wait()


def test_the_memory_check_counts_every_seed(monkeypatch):
    options, task, config = DeepConfig.paper(6, 97, 1000), CircleWalk(6, 0.5, 97), TrainConfig()
    weights, per_sample = options.element_counts()
    one = 8 * (weights + per_sample * 1000)
    monkeypatch.setattr("rwinterp.training.available_memory", lambda device: 3 * one)
    check_memory(options, task, config, copies=2)
    with pytest.raises(RwinterpError, match=r"for 20 models.*or the number of seeds"):
        check_memory(options, task, config, copies=20)


def test_one_thread_per_worker_in_a_fresh_process():
    import subprocess
    import sys

    code = ("import os, torch; from rwinterp.training import one_thread_per_worker; one_thread_per_worker(); "
            "print(torch.get_num_threads(), os.environ['OMP_NUM_THREADS'], os.environ['MKL_NUM_THREADS'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "1", "1"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no GPU")
def test_cuda_without_a_gpu_is_a_one_line_error(capsys):
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(RwinterpError, match="there is no CUDA GPU here"):
        resolve_device("cuda")
    assert main(["train", *SMALL, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device cuda: there is no CUDA GPU here" in err


def test_unknown_devices_are_refused():
    with pytest.raises(RwinterpError, match="device must be one of auto, cpu, cuda"):
        resolve_device("tpu")


# ---------------------------------------------------------------------------------------- on a GPU
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_batch_on_the_gpu_trains_as_on_the_cpu(dtype):
    """The same seeds on the GPU and on the CPU: the same trajectory up to the dtype's round-off (float64: 1e-9
    relative; float32: 1e-3, the GPU's sums running in another order)."""
    task = CircleWalk(5, 0.7, 9)
    options = dict(GAUSSIAN, dtype=dtype)
    configs = [TrainConfig(steps=10, seed=s) for s in SEEDS]
    on_cpu = [build("deep", options, seed) for seed in SEEDS]
    on_gpu = [build("deep", options, seed).to("cuda") for seed in SEEDS]
    cpu_results = train_seeds(on_cpu, task, configs, progress=False)
    gpu_results = train_seeds(on_gpu, task, configs, progress=False)
    rtol = 1e-9 if dtype == "float64" else 1e-3
    for model, result, cpu_model, cpu_result in zip(on_gpu, gpu_results, on_cpu, cpu_results):
        assert model.u.device.type == "cuda"
        torch.testing.assert_close(model.u.detach().cpu(), cpu_model.u.detach(), rtol=rtol,
                                   atol=rtol * float(cpu_model.u.abs().max()))
        losses = [r["loss"] for r in result.history]
        assert all(math.isclose(a, b["loss"], rel_tol=rtol) for a, b in zip(losses, cpu_result.history))


@pytest.mark.cuda
def test_train_on_the_gpu_from_the_command_line(tmp_path, capsys):
    assert main(["train", *SMALL, "--device", "cuda", "--dtype", "float32", "--out", str(tmp_path / "run")]) == 0
    assert main(["train", *SMALL, "--seeds", "0-2", "--device", "cuda", "--out", str(tmp_path / "group")]) == 0
    run = load_run(tmp_path / "group" / "seed-1", device="cuda")
    assert next(run.model.parameters()).device.type == "cuda"
    check_memory(DeepConfig.paper(5, 9, 16), CircleWalk(5, 0.7, 9), TrainConfig(), "cuda", copies=3)
