"""What a new user meets first: refusals in one line with their reason, numbers that say what they are, nothing
left behind. Each test here fails without the mend it checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import transformer_lens.patching as tl_patching

from rwinterp.cli import main
from rwinterp.config import BridgeOptions, DeepOptions
from rwinterp.errors import RwinterpError
from rwinterp.model import DeepConfig, DeepTransformer
from rwinterp.runs import save_run
from rwinterp.tasks import CircleWalk
from tests.conftest import paper_model

SMALL = ["--K", "5", "--N", "9", "--M", "16", "--steps", "3", "--n-train", "40", "--n-test", "40"]


@pytest.mark.parametrize("sweep, what", [
    ("get_act_patch_attn_out", "attn_out by position"),
    ("get_act_patch_attn_head_out_by_pos", "z by position"),
    ("get_act_patch_attn_head_pattern_by_pos", "pattern by position"),
    ("get_act_patch_block_every", "get_act_patch_block_every"),
    ("get_act_patch_resid_mid", "caches no 'blocks.0.hook_resid_mid' (it has no MLP)"),
])
def test_patching_sweeps_a_query_slot_model_cannot_take_are_refused_at_their_first_run(sweep, what):
    """TransformerLens would stop with a bare IndexError or KeyError (block_every only after sweeping the
    residual stream): the refusal comes before any patched run, with the reason."""
    task = CircleWalk(5, 0.7, 9)
    model = paper_model(task, pos_dim=16, init="gaussian", init_sigma=0.3).eval()
    clean, corrupted = task.sample(8, 1), task.sample(8, 2)
    _, cache = model.run_with_cache(clean.tokens)
    runs = []
    real = model.run_with_hooks

    def counted(*args, **kwargs):
        runs.append(1)
        return real(*args, **kwargs)

    model.run_with_hooks = counted
    with pytest.raises(RwinterpError, match=what.replace("(", r"\(").replace(")", r"\)")) as error:
        getattr(tl_patching, sweep)(model, corrupted.tokens, cache, lambda logits: logits[:, -1, 0].mean())
    assert len(runs) <= 1 and "\n" not in str(error.value)
    # The sweeps that apply still run.
    model.run_with_hooks = real
    assert tl_patching.get_act_patch_resid_pre(model, corrupted.tokens, cache, lambda l: l[:, -1, 0].mean()).shape \
        == (1, 9)


@pytest.mark.parametrize("sweep", ["get_act_patch_block_every", "get_act_patch_attn_head_by_pos_every"])
def test_a_causal_model_holds_every_position_and_takes_the_every_position_sweeps(sweep):
    """Only a model attending from the query slot lacks positions; a causal one is patched like any
    HookedTransformer, and its results have a value for every position."""
    from rwinterp.model import DeepConfig, DeepTransformer

    task = CircleWalk(5, 0.7, 6)
    model = DeepTransformer(DeepConfig.standard(5, 6, n_layers=1, n_heads=2, d_model=8, mlp_width=8, seed=1)).eval()
    clean, corrupted = task.sample(4, 1), task.sample(4, 2)
    _, cache = model.run_with_cache(clean.tokens)
    result = getattr(tl_patching, sweep)(model, corrupted.tokens, cache, lambda logits: logits[:, -1, 0].mean())
    assert 6 in result.shape and torch.isfinite(result).all() and result.abs().max() > 0


def test_direct_path_patching_is_refused_in_one_line():
    """TransformerLens' direct path patching needs a query, key and value input per head, which the model does
    not split: one line instead of an AttributeError."""
    task = CircleWalk(5, 0.7, 9)
    for model in (paper_model(task, pos_dim=16), DeepTransformer(DeepConfig.standard(5, 9, 8, n_layers=2))):
        model.eval()
        clean, corrupted = task.sample(8, 1), task.sample(8, 2)
        _, clean_cache = model.run_with_cache(clean.tokens)
        _, corrupted_cache = model.run_with_cache(corrupted.tokens)
        with pytest.raises(RwinterpError, match="does not split the residual stream into a query, key and value"):
            tl_patching.get_act_patch_direct_path(model, corrupted.tokens, clean_cache, corrupted_cache,
                                                  lambda logits: logits[:, -1, 0].mean(), 0, 0)


def test_the_standard_preset_trains_with_its_own_defaults(capsys):
    """It predicts with logits at every position: the preset sets the cross-entropy and next-token training."""
    assert main(["train", "--model", "deep", "--preset", "standard", "--K", "5", "--N", "6", "--steps", "2",
                 "--n-train", "20", "--n-test", "20", "--json"]) == 0
    train = json.loads(capsys.readouterr().out)["train"]
    assert train["loss"] == "xent" and train["next_token"]


@pytest.mark.parametrize("args", [
    ["--model", "deep", "--pos-mode", "added", "--pe", "learned", "--values", "all", "--readout", "learned",
     "--d-model", "7", "--heads", "2"],
    ["--model", "bridge", "--d-model", "7", "--heads", "2"],
])
def test_a_width_that_heads_do_not_divide_is_refused(args, capsys):
    assert main(["train", "--K", "5", "--N", "9", "--steps", "1", *args]) == 2
    assert capsys.readouterr().err == "rwinterp: error: d_model = 7 is not divisible by 2 heads: give d_head\n"


def test_comparing_a_run_with_itself_is_refused(tmp_path, capsys):
    assert main(["train", *SMALL, "--out", str(tmp_path / "a")]) == 0
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "a"), "--out", str(tmp_path / "c")]) == 2
    assert "RUN_A and RUN_B are the same run" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_bad_values_keep_their_type_and_the_least_K_is_one_rule():
    with pytest.raises(RwinterpError, match="the number of states K must be an integer >= 2, got '6'"):
        DeepOptions(n_states="6")
    with pytest.raises(RwinterpError, match="the number of states K must be an integer >= 2, got 1"):
        BridgeOptions(n_states=1)
    DeepOptions(n_states=2, n_ctx=3, pos_dim=4)  # two states: a chain, not a circle
    with pytest.raises(RwinterpError, match=r"a circle needs K >= 3 states \(with 2 the \+1 and -1 steps coincide\)"):
        CircleWalk(2, 0.5, 5)


def test_arguments_are_checked_before_torch_loads():
    """A bad value is refused without waiting for torch and TransformerLens to import."""
    code = ("import sys; from rwinterp.cli import main; status = main(['train', '--K', '1']); "
            "print(status, sorted(m for m in ('torch', 'transformer_lens', 'numpy') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "2 []", done.stdout + done.stderr
    assert done.stderr.strip() == "rwinterp: error: the number of states K must be an integer >= 2, got 1"


def test_printed_parent_attention_names_its_layer_head_and_positions(tmp_path, capsys):
    argv = ["train", "--model", "deep", "--layers", "2", "--residual", "--task", "persistent", "--K", "5", "--N", "6",
            "--M", "12", "--steps", "2", "--n-train", "20", "--n-test", "20", "--out", str(tmp_path / "run")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert ("attention   layer 0 head 0, from the query slot (position 6), on the parent(s) (position 4, 5, "
            "1-indexed): ") in out
    assert main(["probe", str(tmp_path / "run"), "--out", str(tmp_path / "rep"), "--bootstrap", "0",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "(parent_attention and parent_argmax_rate: head L" in out and "from the query slot (position 6))" in out


def test_a_write_killed_outright_is_cleaned_by_the_next(tmp_path):
    """SIGKILL cannot remove the temporary directory of a save; the next save beside it does, once its process
    is gone (a live process's is left alone)."""
    task = CircleWalk(5, 0.7, 9)
    model = paper_model(task, pos_dim=16)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".run.tmp-{int(dead.stdout)}-0123abcd"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    alive = tmp_path / f".run.tmp-{os.getpid()}-0123abcd"
    alive.mkdir()
    save_run(tmp_path / "run", model, task, {}, [], {})
    assert not stale.exists() and alive.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [alive.name, "run"]


@pytest.mark.slow  # a reproduction (its worker pool) and a training run
def test_output_directories_take_the_umask_like_runs_and_reports(tmp_path, capsys):
    mask = os.umask(0o022)
    os.umask(mask)
    assert main(["reproduce", "2", "--out", str(tmp_path / "r"), "--no-progress"]) == 0
    assert main(["train", *SMALL, "--out", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    for name in ("r", "run"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o777 & ~mask, name
