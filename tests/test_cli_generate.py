"""`jaxkv generate` on a checkpoint with a tokenizer: many prompts as one batch, chat
templates and BOS as transformers applies them, tenants, sizing from a memory budget."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from jaxkv import cli, models
from jaxkv._checks import host_memory_bytes
from jaxkv.models.prompting import PromptEncoder
from jaxkv.models.testing import save_word_tokenizer
from jaxkv.testing.reference import DenseReference

SPECIALS = {0: "<unk>", 1: "<bos>", 2: "<eos>", 3: "<turn>", 4: "<end>"}
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<turn> {{ m['content'] }} <end> {% endfor %}"
    "{% if add_generation_prompt %}<turn>{% endif %}"
)
REPO = Path(__file__).resolve().parent.parent


def write_tokenizer(path: Path, **config) -> None:
    save_word_tokenizer(path, 256, SPECIALS)
    config = {"bos_token": "<bos>", "eos_token": "<eos>", **config}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    models.save_random_checkpoint(path, models.tiny_configs()["llama-tiny"], seed=0)
    write_tokenizer(
        path, tokenizer_class="LlamaTokenizerFast", add_bos_token=True, chat_template=TEMPLATE
    )
    return path


def generate(checkpoint, capsys, *argv: str) -> tuple[list[dict], str]:
    assert cli.main(["generate", "--model", str(checkpoint), "--json", *argv]) == 0
    captured = capsys.readouterr()
    return [json.loads(line) for line in captured.out.strip().splitlines()], captured.err


def test_prompts_file_serves_a_batch_with_prefix_hits(checkpoint, capsys, tmp_path) -> None:
    shared = " ".join(f"w{i}" for i in range(10, 50))
    lines = [{"prompt": f"{shared} w7"}, {"prompt": f"{shared} w8", "max_tokens": 3}, None,
             {"prompt": f"{shared} w9"}]  # fmt: skip
    text = "\r\n".join("" if line is None else json.dumps(line) for line in lines)
    (tmp_path / "prompts.jsonl").write_text(text)
    results, err = generate(
        checkpoint, capsys, "--prompts", str(tmp_path / "prompts.jsonl"), "--max-tokens", "5",
        "--max-num-seqs", "1", "--kv-cache-memory", "4MiB",
    )  # fmt: skip
    assert len(results) == 3
    assert [r["prompt_token_ids"][0] for r in results] == [1, 1, 1], "add_bos_token honoured"
    assert [len(r["output_token_ids"]) for r in results] <= [5, 3, 5]
    assert results[1]["num_cached_tokens"] > 0 and results[2]["num_cached_tokens"] > 0
    reference = DenseReference(models.load_model(checkpoint), 512)
    for r in results:
        assert r["output_token_ids"] == reference.expected(r["prompt_token_ids"],
                                                           r["output_token_ids"])  # fmt: skip
    assert "3 prompts" in err and "tokens/s" in err
    assert "KV cache:" in err and f"in {4 * 2**20:,} bytes" in err, "says what was sized"


def test_chat_template_and_cache_salt(checkpoint, capsys) -> None:
    (result,), _ = generate(checkpoint, capsys, "--prompt", "w5 w6", "--chat")
    assert result["prompt_token_ids"] == [1, 3, 5, 6, 4, 3]
    shared = " ".join(f"w{i}" for i in range(10, 50))
    (a,), _ = generate(checkpoint, capsys, "--prompt", shared, "--cache-salt", "tenant-a")
    assert a["num_cached_tokens"] == 0  # a new engine per command: nothing cached yet


def test_prompt_encoder_flags_follow_the_tokenizer_class(tmp_path) -> None:
    write_tokenizer(tmp_path, tokenizer_class="GemmaTokenizer", add_bos_token=True,
                    add_eos_token=True)  # fmt: skip
    tokenizer = models.load_tokenizer(tmp_path)
    assert PromptEncoder.from_dir(tmp_path, tokenizer).encode("w5 w6") == [1, 5, 6, 2]
    write_tokenizer(tmp_path, tokenizer_class="PreTrainedTokenizerFast", add_bos_token=True)
    assert PromptEncoder.from_dir(tmp_path, tokenizer).encode("w5 w6") == [5, 6]
    with pytest.raises(ValueError, match="chat template"):
        PromptEncoder.from_dir(tmp_path, tokenizer).encode("w5", chat=True)


def test_prompt_encoder_matches_transformers(tmp_path) -> None:
    """The generic backend ignores add_bos_token; the chat template renders the same ids."""
    peer = REPO / ".venv-vllm" / "bin" / "python"
    if not peer.exists():
        pytest.skip("needs the peer environment (tools/vllm-peer-venv.sh) for transformers")
    write_tokenizer(tmp_path, tokenizer_class="PreTrainedTokenizerFast", add_bos_token=True,
                    chat_template=TEMPLATE)  # fmt: skip
    script = (
        "import sys, json, transformers\n"
        "t = transformers.AutoTokenizer.from_pretrained(sys.argv[1])\n"
        "chat = t.apply_chat_template([{'role': 'user', 'content': 'w5 w6'}],"
        " add_generation_prompt=True, tokenize=True, return_dict=True)['input_ids']\n"
        "print(json.dumps([t('w5 w6 w7').input_ids, chat]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(peer), "-c", script, str(tmp_path)], capture_output=True,
                          text=True, env=env, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    plain, chat = json.loads(proc.stdout.strip().splitlines()[-1])
    encoder = PromptEncoder.from_dir(tmp_path, models.load_tokenizer(tmp_path))
    assert encoder.encode("w5 w6 w7") == plain
    assert encoder.encode("w5 w6", chat=True) == chat


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompt-token-ids", "1", "--kv-cache-memory", "40kB", "--max-model-len", "64"],
         "the longest max_model_len that fits"),
        (["--prompt-token-ids", "1", "--kv-cache-memory", "lots"], "--kv-cache-memory 'lots'"),
        (["--prompt-token-ids", "1", "--gpu-memory-utilization", "2"],
         "--gpu-memory-utilization must be in (0, 1]"),
        (["--prompt-token-ids", "1", "--chat"], "--chat needs --prompt"),
        (["--prompt-token-ids", "1", "--kv-events-topic", "t"],
         "--kv-events-redact-prompts and the --kv-events-* bounds need --kv-events-endpoint"),
        (["--prompt-token-ids", "1", "--kv-events-redact-prompts"],
         "--kv-events-redact-prompts and the --kv-events-* bounds need --kv-events-endpoint"),
        (["--prompt-token-ids", "1", "--kv-events-buffer-steps", "5"],
         "bounds need --kv-events-endpoint"),
        (["--prompt-token-ids", "1", "--kv-events-endpoint", "tcp://*:5557",
          "--kv-events-hwm", "0"], "--kv-events-hwm must be a positive integer, got 0"),
        (["--prompt-token-ids", "1", "--kv-events-endpoint", "localhost:5557"],
         "--kv-events-endpoint must be a ZeroMQ address"),
        (["--prompt-token-ids", "1", "--kv-events-endpoint", "tcp://127.0.0.1:99999"],
         "--kv-events-endpoint 'tcp://127.0.0.1:99999': give tcp://HOST:PORT with PORT an "
         "integer in 1..65535"),
        (["--prompt-token-ids", "1", "--kv-events-endpoint", "tcp://*:5557",
          "--kv-events-replay-endpoint", "tcp://*:0"],
         "--kv-events-replay-endpoint 'tcp://*:0': give tcp://HOST:PORT"),
        (["--prompts", "/dev/zero"], "--prompts /dev/zero: larger than 67108864 bytes"),
        (["--prompt-token-ids", "1", "--kv-offloading-size", "1e30"],
         "--kv-offloading-size is 1000000000000000019884624838656 bytes, more than this host's"),
        (["--prompt-token-ids", "1", "--kv-offloading-size", f"{2 * host_memory_bytes()}B"],
         f"--kv-offloading-size is {2 * host_memory_bytes()} bytes, more than this host's"),
    ],
)  # fmt: skip
def test_generate_sizing_errors_are_one_line(checkpoint, capsys, argv, message) -> None:
    assert cli.main(["generate", "--model", str(checkpoint), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_chat_template_doing_too_much_work_is_one_line(checkpoint, capsys, tmp_path) -> None:
    for file in checkpoint.iterdir():  # the weights and config; a tokenizer of its own
        if not file.name.startswith("tokenizer"):
            (tmp_path / file.name).symlink_to(file)
    write_tokenizer(tmp_path, chat_template="{% for i in range(10**9) %}x{% endfor %}")
    argv = ["generate", "--model", str(tmp_path), "--prompt", "w1", "--chat"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxkv: error: chat template: its ranges span more than 100000")
    assert err.count("\n") == 1


def test_huge_seed_from_the_command_line(checkpoint, capsys) -> None:
    """A 64-bit seed on the command line samples; in-process (`python -m jaxkv` itself is
    test_cli's): a subprocess would pay Python's and JAX's start-up for nothing more."""
    (result,), _ = generate(
        checkpoint, capsys, "--prompt-token-ids", "5,6,7", "--seed", "1099511627776",
        "--temperature", "0.8", "--max-tokens", "4", "--num-blocks", "64",
    )  # fmt: skip
    assert len(result["output_token_ids"]) == 4


def test_kv_events_flags_publish_the_batch(checkpoint, capsys, tmp_path, monkeypatch) -> None:
    """`--kv-events-*` reach the engine: it publishes the batch's events there (what a
    subscriber hears is `tests/test_kv_events_wire.py`'s), and shuts its publisher down."""
    import jaxkv.engine

    engines = []

    class Recorded(jaxkv.engine.LLMEngine):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            engines.append(self)

    monkeypatch.setattr(jaxkv.engine, "LLMEngine", Recorded)
    endpoint = f"ipc://{tmp_path}/events"
    shared = " ".join(f"w{i}" for i in range(10, 50))
    (tmp_path / "prompts.txt").write_text(f"{shared} w7\n{shared} w8\n")
    generate(
        checkpoint, capsys, "--prompts", str(tmp_path / "prompts.txt"), "--max-tokens", "2",
        "--max-num-seqs", "1", "--kv-cache-memory", "4MiB", "--kv-events-endpoint", endpoint,
        "--kv-events-replay-endpoint", f"ipc://{tmp_path}/replay", "--kv-events-topic", "kv",
        "--kv-events-hwm", "50", "--kv-events-buffer-steps", "7", "--kv-events-max-queue-size",
        "11", "--kv-events-replay-hwm", "9",
    )  # fmt: skip
    (publisher,) = engines[0].kv_event_publishers
    assert publisher.endpoint == endpoint and publisher.replay_endpoint.endswith("/replay")
    assert (publisher._hwm, publisher._buffer.maxlen, publisher.max_queue_size) == (50, 7, 11)
    assert publisher._replay_hwm == 9
    assert publisher.num_sent > 0 and publisher.num_dropped == 0
    with pytest.raises(RuntimeError, match="shut down"):
        publisher.publish([])


def test_scan_layers_on_and_off_give_the_same_tokens(checkpoint, capsys) -> None:
    argv = ("--prompt", "w10 w11 w12 w13", "--max-tokens", "4", "--kv-cache-memory", "4MiB")
    scanned, _ = generate(checkpoint, capsys, *argv, "--scan-layers", "on")
    per_layer, _ = generate(checkpoint, capsys, *argv, "--scan-layers", "off")
    assert scanned[0]["output_token_ids"] == per_layer[0]["output_token_ids"]
    assert len(scanned[0]["output_token_ids"]) == 4
    with pytest.raises(SystemExit):
        cli.main(["generate", "--model", str(checkpoint), "--prompt", "w1", "--scan-layers", "x"])
