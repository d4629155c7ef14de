"""Bad checkpoints, files and flags: each is one ValueError line naming the file (and the
tensor, field or flag) and what is allowed; the `jaxkv` command prints it as
`jaxkv: error: ...` and exits 2, with no traceback. Config fields are checked before
any weight is read. Also: the tensor layouts the loader accepts besides jaxkv's own."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file, save_file

from jaxkv import cli
from jaxkv.models import (
    load_image,
    load_model,
    load_tokenizer,
    save_random_checkpoint,
    tiny_configs,
)
from jaxkv.models.checkpoint import INDEX_FILE, SINGLE_FILE

LLAMA_TENSOR = "model.layers.0.mlp.up_proj.weight"  # [128, 64] in llama-tiny


@pytest.fixture
def llama(tmp_path):
    path = tmp_path / "llama"
    save_random_checkpoint(path, tiny_configs()["llama-tiny"], seed=1)
    return path


@pytest.fixture
def llava(tmp_path):
    path = tmp_path / "llava"
    save_random_checkpoint(path, tiny_configs()["llava-tiny"], seed=1)
    return path


def edit_config(path, edit) -> None:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def truncate(file, keep: float = 0.5) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


def load_error(path) -> str:
    """The one-line message `load_model(path)` fails with."""
    with pytest.raises(ValueError) as info:
        load_model(path)
    message = str(info.value)
    assert "\n" not in message
    return message


# --------------------------------------------------------------------------- config.json


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_hidden_layers", -1, "num_hidden_layers must be a positive integer, got -1"),
        ("max_position_embeddings", 0, "max_position_embeddings must be a positive integer, got 0"),
        ("hidden_size", 0, "hidden_size must be a positive integer, got 0"),
        ("vocab_size", "256", "vocab_size must be a positive integer, got '256'"),
        ("intermediate_size", 128.0, "intermediate_size must be a positive integer, got 128.0"),
        ("num_attention_heads", True, "num_attention_heads must be a positive integer, got True"),
        ("num_key_value_heads", 0, "num_key_value_heads must be a positive integer, got 0"),
        ("num_key_value_heads", 3, "4 is not a multiple of num_key_value_heads 3"),
        ("head_dim", 0, "head_dim must be a positive even integer"),
        ("head_dim", 15, "head_dim must be a positive even integer"),
        ("eos_token_id", [2, "x"], "eos_token_id must be a token id"),
        ("bos_token_id", -1, "bos_token_id must be a token id"),
        ("rope_theta", -1.0, "rope_theta must be a positive number, got -1.0"),
        ("rms_norm_eps", "tiny", "rms_norm_eps must be a number >= 0, got 'tiny'"),
        ("tie_word_embeddings", "no", "tie_word_embeddings must be true or false, got 'no'"),
        ("rope_scaling", [1], "rope_scaling must be a JSON object, got [1]"),
        ("architectures", "LlamaForCausalLM", "architectures must be a list of class names"),
    ],
)  # fmt: skip
def test_bad_config_field_is_refused_before_any_weight_is_read(llama, field, value, message):
    edit_config(llama, lambda c: c.update({field: value}))
    truncate(llama / SINGLE_FILE)  # never opened: the config is refused first
    error = load_error(llama)
    assert error.startswith(f"{llama / 'config.json'}: ")
    assert message in error


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c.update(image_token_index=256),
         "image_token_index 256 is outside the vocabulary (text_config vocab_size 256)"),
        (lambda c: c["text_config"].update(num_hidden_layers=-1),
         "config.json text_config: num_hidden_layers must be a positive integer, got -1"),
        (lambda c: c["vision_config"].update(image_size=15),
         "config.json vision_config: image_size 15 must be a multiple of patch_size 4"),
        (lambda c: c["vision_config"].update(hidden_size=0),
         "config.json vision_config: hidden_size must be a positive integer, got 0"),
        (lambda c: c.update(vision_feature_layer=4),
         "vision_feature_layer 4 must be one layer, an integer in [-4, 3]"),
        (lambda c: c.update(text_config="llama"), "text_config must be a JSON object"),
    ],
)  # fmt: skip
def test_bad_llava_config_field(llava, edit, message):
    edit_config(llava, edit)
    assert message in load_error(llava)


def test_config_that_is_not_json(llama):
    (llama / "config.json").write_text('{"model_type": "llama",')
    assert re.fullmatch(rf"{re.escape(str(llama / 'config.json'))}: not valid JSON \(.+\)",
                        load_error(llama))  # fmt: skip


# --------------------------------------------------------------------------- safetensors


@pytest.mark.parametrize("keep", [0.5, 0.001])  # the data cut short; the header cut short
def test_truncated_safetensors(llama, keep):
    truncate(llama / SINGLE_FILE, keep)
    error = load_error(llama)
    assert error.startswith(f"{llama / SINGLE_FILE}: not a readable safetensors file (")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (np.zeros((64, 64), np.float32), "has shape (64, 64), expected (128, 64)"),
        (np.zeros((128, 64), np.int64),
         "has dtype I64; weights must be floating point (F16, BF16, F32, F64)"),
        (np.zeros((128, 64), bool),
         "has dtype BOOL; weights must be floating point (F16, BF16, F32, F64)"),
    ],
)  # fmt: skip
def test_tensor_of_wrong_shape_or_dtype(llama, value, message):
    tensors = load_file(llama / SINGLE_FILE)
    tensors[LLAMA_TENSOR] = value
    save_file(tensors, llama / SINGLE_FILE)
    assert load_error(llama) == f"{llama / SINGLE_FILE}: tensor {LLAMA_TENSOR!r} {message}"


def test_float16_and_bfloat16_weights_load(llama):
    import ml_dtypes

    tensors = load_file(llama / SINGLE_FILE)
    tensors[LLAMA_TENSOR] = tensors[LLAMA_TENSOR].astype(ml_dtypes.bfloat16)
    tensors["lm_head.weight"] = tensors["lm_head.weight"].astype(np.float16)
    save_file(tensors, llama / SINGLE_FILE)
    model = load_model(llama)
    np.testing.assert_array_equal(
        model.decoder.layers[0].up_proj.weight[...][0],
        tensors[LLAMA_TENSOR].astype(np.float32),
    )


@pytest.fixture
def sharded(tmp_path):
    path = tmp_path / "sharded"
    save_random_checkpoint(path, tiny_configs()["llama-tiny"], seed=1, num_shards=2)
    return path


def test_index_maps_a_tensor_to_a_shard_that_lacks_it(sharded):
    index = json.loads((sharded / INDEX_FILE).read_text())
    weight_map = index["weight_map"]
    shards = sorted(set(weight_map.values()))
    name = next(n for n, f in weight_map.items() if f == shards[0])
    weight_map[name] = shards[1]
    (sharded / INDEX_FILE).write_text(json.dumps(index))
    assert load_error(sharded) == (
        f"{sharded / INDEX_FILE} maps tensor {name!r} to shard {shards[1]}, which does not hold it"
    )


def test_missing_shard_and_bad_index(sharded):
    (sharded / "model-00002-of-00002.safetensors").unlink()
    assert load_error(sharded) == (
        f"{sharded / INDEX_FILE} names shard model-00002-of-00002.safetensors, which does not exist"
    )
    (sharded / INDEX_FILE).write_text("[]")
    assert "no 'weight_map' object" in load_error(sharded)


# --------------------------------------------------------------------------- tensor layouts


def rename_tensors(path, rename) -> None:
    tensors = load_file(path / SINGLE_FILE)
    save_file({rename(n): v for n, v in tensors.items()}, path / SINGLE_FILE)


def test_a_bare_base_model_loads(llama):
    """`LlamaModel.save_pretrained` names have no `model.`; transformers loads them."""
    before = load_model(llama)
    rename_tensors(llama, lambda n: n.removeprefix("model."))
    ids = np.arange(1, 9, dtype=np.int32)
    np.testing.assert_array_equal(load_model(llama).dense_fn()(ids), before.dense_fn()(ids))


def test_unknown_layout_names_the_prefixes_looked_for_and_found(llama, llava):
    rename_tensors(llama, lambda n: n.replace("model.", "transformer.", 1))
    assert load_error(llama) == (
        f"checkpoint {llama}: no decoder tensors: looked for 'model.embed_tokens.weight', "
        "'embed_tokens.weight'; the checkpoint's tensor names start with 'lm_head.', "
        "'transformer.embed_tokens.', 'transformer.layers.', 'transformer.norm.'"
    )
    rename_tensors(llava, lambda n: n.replace("vision_model.", "vit.", 1))
    error = load_error(llava)
    assert "no LLaVA vision tower tensors: looked for " in error
    assert "'vision_tower.embeddings.patch_embedding.weight'" in error
    assert "start with 'lm_head.', 'model.language_model.', 'model.multi_modal_projector.', " \
        "'model.vision_tower.'" in error  # fmt: skip


def test_untied_model_without_its_output_head(llama):
    rename_tensors(llama, lambda n: "unused.weight" if n == "lm_head.weight" else n)
    assert "no output head tensors: looked for 'lm_head.weight'" in load_error(llama)


# --------------------------------------------------------------------------- other files


def test_corrupt_tokenizer(llama):
    (llama / "tokenizer.json").write_text('{"version": "1.0", "model": {')
    with pytest.raises(ValueError) as info:
        load_tokenizer(llama)
    assert str(info.value).startswith(f"{llama / 'tokenizer.json'}: not a tokenizer.json ")


@pytest.fixture
def images(tmp_path):
    """Bad image files by kind: a text file, a truncated PNG, a directory, a missing file."""
    png = tmp_path / "image.png"
    pixels = np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(png)
    truncate(png)
    (tmp_path / "notes.png").write_text("not an image")
    return {
        "text": tmp_path / "notes.png",
        "truncated": png,
        "directory": tmp_path,
        "missing": tmp_path / "nope.png",
    }


@pytest.mark.parametrize("kind", ["text", "truncated", "directory", "missing"])
def test_bad_image_file(images, kind):
    with pytest.raises(ValueError) as info:
        load_image(images[kind])
    assert str(info.value).startswith(f"{images[kind]}: not an image file PIL can read in full")


# --------------------------------------------------------------------------- the command


def run_cli(capsys, *argv: str) -> str:
    """The one stderr line of `jaxkv argv`, which must exit 2."""
    assert cli.main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jaxkv: error: "), err
    return err.strip()


@pytest.mark.parametrize("kind", ["text", "truncated", "directory"])
def test_generate_bad_image(llava, images, capsys, kind):
    (llava / "preprocessor_config.json").write_text(json.dumps({"size": 16, "crop_size": 16}))
    err = run_cli(capsys, "generate", "--model", str(llava), "--prompt-token-ids", "1,2",
                  "--image", str(images[kind]))  # fmt: skip
    assert f"{images[kind]}: not an image file" in err


def test_generate_bad_preprocessor_config(llava, images, capsys):
    (llava / "preprocessor_config.json").write_text("{size: 16}")
    err = run_cli(capsys, "generate", "--model", str(llava), "--prompt-token-ids", "1",
                  "--image", str(images["truncated"]))  # fmt: skip
    assert f"{llava / 'preprocessor_config.json'}: not valid JSON" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-model-len", "0"], "--max-model-len must be a positive integer, got 0"),
        (["--max-num-batched-tokens", "0"],
         "--max-num-batched-tokens must be a positive integer, got 0"),
        (["--max-tokens", "-1"], "--max-tokens must be a positive integer, got -1"),
    ],
)  # fmt: skip
def test_generate_bad_flag(llama, capsys, argv, message):
    err = run_cli(capsys, "generate", "--model", str(llama), "--prompt-token-ids", "1", *argv)
    assert err == f"jaxkv: error: {message}"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--memory", "1e400"], "--memory '1e400' is not a size; use a finite number"),
        (["--max-model-len", "0"], "--max-model-len must be a positive integer, got 0"),
        (["--max-num-batched-tokens", "0"],
         "--max-num-batched-tokens must be a positive integer, got 0"),
        (["--block-size", "0"], "--block-size must be a positive integer, got 0"),
    ],
)  # fmt: skip
def test_plan_bad_flag(llama, capsys, argv, message):
    base = {"--memory": "1MiB", "--max-model-len": "64"}
    flags = {**base, **dict(zip(argv[::2], argv[1::2], strict=True))}
    err = run_cli(capsys, "plan", "--model", str(llama),
                  *(x for kv in flags.items() for x in kv))  # fmt: skip
    assert err.startswith(f"jaxkv: error: {message}")


def test_generate_and_plan_bad_files(llama, capsys):
    (llama / "tokenizer.json").write_text("{")
    err = run_cli(capsys, "generate", "--model", str(llama), "--prompt", "w1 w2")
    assert f"{llama / 'tokenizer.json'}: not a tokenizer.json" in err
    (llama / "tokenizer.json").unlink()
    truncate(llama / SINGLE_FILE)
    err = run_cli(capsys, "generate", "--model", str(llama), "--prompt-token-ids", "1")
    assert f"{llama / SINGLE_FILE}: not a readable safetensors file" in err
    (llama / "config.json").write_text("nope")
    err = run_cli(capsys, "plan", "--model", str(llama), "--memory", "1MiB",
                  "--max-model-len", "64")  # fmt: skip
    assert f"{llama / 'config.json'}: not valid JSON" in err


def test_a_bug_keeps_its_traceback(llama, monkeypatch):
    def broken(args):
        raise KeyError("a bug")

    monkeypatch.setattr(cli, "cmd_plan", broken)
    with pytest.raises(KeyError, match="a bug"):
        cli.main(["plan", "--model", str(llama), "--memory", "1MiB", "--max-model-len", "64"])


@pytest.mark.parametrize(
    ("case", "needle"),
    [("truncated", SINGLE_FILE), ("image", "notes.png"), ("memory", "--memory '1e400'")],
)
def test_command_exits_2_with_one_line(llama, tmp_path, case, needle):
    """As a user runs it: `python -m jaxkv`, exit 2, one stderr line, no traceback."""
    argv = ["generate", "--model", str(llama), "--prompt-token-ids", "1,2"]
    if case == "truncated":
        truncate(llama / SINGLE_FILE)
    elif case == "image":
        (llama / "preprocessor_config.json").write_text("{}")
        (tmp_path / "notes.png").write_text("not an image")
        argv += ["--image", str(tmp_path / "notes.png")]
    else:
        argv = ["plan", "--model", str(llama), "--memory", "1e400", "--max-model-len", "64"]
    result = subprocess.run(
        [sys.executable, "-m", "jaxkv", *argv], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxkv: error: "), result.stderr
    assert needle in lines[0] and "Traceback" not in result.stderr
