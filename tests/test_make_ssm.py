"""`make-ssm`: an SSM cut from the LLM's layers is exactly the LLM with the other layers deleted
(and, pruned, with the dropped MLP channels zeroed); it loads in the engine and in transformers."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from specinfer.errors import UserError
from specinfer.pool.make_ssm import make_ssm, parse_layers
from specinfer.engine.runtime.runner import ModelRunner, chain_work
from util import save_tiny_llama

TOKENS = [3, 17, 5, 60, 2, 9, 33, 41, 7, 7, 12, 50]


@pytest.fixture(scope="module")
def llm_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("make_ssm")
    untied = save_tiny_llama(root / "llm", vocab=64, hidden=32, layers=4, heads=4, kv_heads=2, intermediate=48, seed=3)
    tied = save_tiny_llama(root / "llm-tied", vocab=64, hidden=32, layers=3, heads=4, kv_heads=4, intermediate=40,
                           tie=True, seed=4)
    (untied / "tokenizer.json").write_text("{}")  # any tokenizer file is copied along
    return {"untied": untied, "tied": tied}


def hf_with_layers(model_dir, layers, zero_channels=None):
    """The LLM in transformers with every other layer deleted (and dropped MLP channels zeroed)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.model.layers = torch.nn.ModuleList([model.model.layers[i] for i in layers])
    model.config.num_hidden_layers = len(layers)
    if zero_channels is not None:
        with torch.no_grad():
            for layer, keep in zip(model.model.layers, zero_channels):
                drop = torch.ones(layer.mlp.gate_proj.weight.shape[0], dtype=torch.bool)
                drop[keep] = False
                layer.mlp.gate_proj.weight[drop] = 0.0
    return model


def hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([TOKENS]), use_cache=False).logits[0].float()


def engine_logits(model_dir) -> torch.Tensor:
    runner = ModelRunner.from_dir(model_dir, max_kv_tokens=64)
    seq = runner.new_sequence()
    logits = runner.run([chain_work(seq, TOKENS, "all")])[0]
    seq.free()
    return logits.float()


@pytest.mark.parametrize("which,layers_arg,layers", [("untied", "0,2", [0, 2]), ("untied", "3", [0, 1, 2]),
                                                     ("tied", "2", [0, 1]), ("untied", "1-2", [1, 2])])
def test_layer_subset_equals_deleted_layers(tmp_path, llm_dirs, which, layers_arg, layers):
    out = make_ssm(llm_dirs[which], tmp_path / "ssm", layers_arg)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == len(layers)
    assert {"model.safetensors", "generation_config.json", "config.json"} <= {p.name for p in out.iterdir()}
    expected = hf_logits(hf_with_layers(llm_dirs[which], layers))
    loaded = hf_logits(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval())
    torch.testing.assert_close(loaded, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(engine_logits(out), expected, rtol=1e-4, atol=1e-4)
    if which == "untied":
        assert (out / "tokenizer.json").is_file()


def test_pruning_keeps_largest_channels(tmp_path, llm_dirs):
    from safetensors.torch import load_file

    src = llm_dirs["untied"]
    out = make_ssm(src, tmp_path / "pruned", "1,3", mlp_keep=0.5)
    assert json.loads((out / "config.json").read_text())["intermediate_size"] == 24
    original, pruned = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    kept = []
    for new, old in enumerate([1, 3]):
        p = f"model.layers.{old}.mlp."
        norms = (original[p + "gate_proj.weight"].pow(2).sum(1) + original[p + "up_proj.weight"].pow(2).sum(1)
                 + original[p + "down_proj.weight"].pow(2).sum(0)).sqrt()
        keep = torch.sort(torch.topk(norms, 24).indices).values
        kept.append(keep)
        q = f"model.layers.{new}.mlp."
        assert torch.equal(pruned[q + "gate_proj.weight"], original[p + "gate_proj.weight"][keep])
        assert torch.equal(pruned[q + "up_proj.weight"], original[p + "up_proj.weight"][keep])
        assert torch.equal(pruned[q + "down_proj.weight"], original[p + "down_proj.weight"][:, keep])
    expected = hf_logits(hf_with_layers(src, [1, 3], zero_channels=kept))
    torch.testing.assert_close(engine_logits(out), expected, rtol=1e-4, atol=1e-4)
    loaded = hf_logits(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval())
    torch.testing.assert_close(loaded, expected, rtol=1e-5, atol=1e-5)


def test_parse_layers():
    assert parse_layers("2", 4) == (0, 1)
    assert parse_layers("3,0", 4) == (0, 3)
    assert parse_layers("0-1,3", 4) == (0, 1, 3)


def _cli(argv):
    from specinfer.cli.main import _Parser
    from specinfer.pool.commands import add_pool_parsers, run_pool_command

    parser = _Parser(prog="specinfer")
    add_pool_parsers(parser.add_subparsers(dest="command", required=True, parser_class=_Parser))
    args = parser.parse_args(argv)
    return run_pool_command(args)


@pytest.mark.parametrize("layers,keep,message", [
    ("abc", "1", "malformed --layers"), ("0,9", "1", "out of range"), ("0,0", "1", "listed twice"),
    ("0", "1", "keep between 1 and 4"), ("5", "1", "keep between 1 and 4"), ("2,", "1", "malformed --layers"),
    ("3-1", "1", "runs backwards"), ("2", "0", "(0, 1]"), ("2", "1.5", "(0, 1]"),
])
def test_bad_input_is_one_line_user_error(tmp_path, llm_dirs, layers, keep, message):
    with pytest.raises(UserError) as exc:
        _cli(["make-ssm", "--from-llm", str(llm_dirs["untied"]), "--layers", layers, "--mlp-keep", keep,
              "--out", str(tmp_path / "o")])
    assert message in str(exc.value) and "\n" not in str(exc.value)
    assert not (tmp_path / "o").exists()


def test_missing_dir_and_nonempty_out(tmp_path, llm_dirs, capsys):
    with pytest.raises(UserError, match="not found"):
        _cli(["make-ssm", "--from-llm", str(tmp_path / "nope"), "--layers", "1", "--out", str(tmp_path / "o")])
    with pytest.raises(UserError, match="required"):
        _cli(["make-ssm", "--layers", "1", "--out", str(tmp_path / "o")])
    assert _cli(["make-ssm", "--from-llm", str(llm_dirs["untied"]), "--layers", "1", "--out", str(tmp_path / "o")]) == 0
    assert json.loads(capsys.readouterr().out)["num_hidden_layers"] == 1
    with pytest.raises(UserError, match="not empty"):
        _cli(["make-ssm", "--from-llm", str(llm_dirs["untied"]), "--layers", "1", "--out", str(tmp_path / "o")])
    assert _cli(["make-ssm", "--from-llm", str(llm_dirs["untied"]), "--layers", "2", "--out", str(tmp_path / "o"),
                 "--overwrite"]) == 0
    assert json.loads((tmp_path / "o" / "config.json").read_text())["num_hidden_layers"] == 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial directories left


def test_parsers_are_argparse_subcommands():
    parser = argparse.ArgumentParser()
    from specinfer.pool.commands import add_pool_parsers

    add_pool_parsers(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["make-ssm", "--from-llm", "x", "--layers", "1", "--out", "y"])
    assert args.command == "make-ssm" and args.mlp_keep == 1.0
