"""GpuReader: NVML through a fake pynvml, re-read per beat, CUDA indices mapped by UUID, sums.

Also the start rule of the measured capacity (:func:`booked_kv_cache_mib`): a model
whose weights plus one full-context sequence do not fit the measured free memory is
refused with the GPU, the free MiB and the need in the message.
"""

from __future__ import annotations

import logging

import pytest

from inferq.config import Settings
from inferq.errors import ConfigError
from inferq.models import ServerTelemetry
from inferq.workers.gpu import GpuInfo, GpuReader, configured_gpu
from inferq.workers.telemetry import booked_kv_cache_mib, measured_kv_free_mib, min_kv_mib

from ..fakes.nvml import GIB, MIB, FakeGpu, FakeMig, fake_pynvml, install

SPECS = Settings().model_by_name
H200_MIB = 143_771

#: Four GPUs of a machine, in NVML (PCI) order.
FOUR = ["GPU-0a0a", "GPU-1b1b", "GPU-2c2c", "GPU-3d3d"]


def machine(monkeypatch: pytest.MonkeyPatch, n: int = 4, **kw: object) -> object:
    gpus = [FakeGpu(uuid, **kw) for uuid in FOUR[:n]]  # type: ignore[arg-type]
    return install(monkeypatch, fake_pynvml(gpus))


def reader(indices: tuple[int, ...] | None, cuda: str | None = None) -> GpuReader:
    env = {} if cuda is None else {"CUDA_VISIBLE_DEVICES": cuda}
    return GpuReader(indices, 24_576, environ=env)


def test_without_pynvml_the_configured_vram_stands_in(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, None)  # makes `import pynvml` raise ImportError
    gpus = reader(None)
    assert not gpus.measured
    assert gpus.read() == GpuInfo(name="", total_mib=24_576, free_mib=24_576, source="config")
    assert GpuReader(None, None).read() == configured_gpu(0)


def test_without_a_driver_the_configured_vram_stands_in(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, fake_pynvml(fail_init=True))
    assert reader((0,)).read() == configured_gpu(24_576)


def test_memory_is_read_again_on_every_read(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = machine(monkeypatch, 1)
    gpus = reader(None)
    first = gpus.read()
    assert (first.total_mib, first.free_mib, first.used_mib) == (H200_MIB, H200_MIB, 0)
    assert (first.name, first.uuids, first.source) == ("NVIDIA H200", ("GPU-0a0a",), "nvml")
    nvml.gpus[0].free = 40 * GIB  # the H200: another process took ~100 GiB
    later = gpus.read()
    assert (later.free_mib, later.used_mib) == (40_960, H200_MIB - 40_960)
    assert nvml.calls.count("memory:0") == 2
    assert nvml.calls.count("init") == 1  # handles resolved once, not per beat
    gpus.close()
    assert nvml.initialised == 0


@pytest.mark.parametrize(
    ("cuda", "index", "uuid"),
    [
        (None, 2, "GPU-2c2c"),  # no variable: CUDA and NVML count alike
        ("2,3", 0, "GPU-2c2c"),  # CUDA device 0 is the third GPU
        ("2,3", 1, "GPU-3d3d"),
        ("3,0", 0, "GPU-3d3d"),  # the variable's order, not NVML's
        ("GPU-1b1b,GPU-3d3d", 1, "GPU-3d3d"),  # UUIDs
        ("GPU-3d", 0, "GPU-3d3d"),  # a unique UUID prefix, as CUDA accepts
        (" 1 , 2 ", 1, "GPU-2c2c"),
    ],
)
def test_a_cuda_index_is_mapped_to_its_gpu_by_uuid(
    monkeypatch: pytest.MonkeyPatch, cuda: str | None, index: int, uuid: str
) -> None:
    nvml = machine(monkeypatch)
    nvml.gpus[FOUR.index(uuid)].free = 7 * GIB  # only that GPU has 7 GiB free
    info = reader((index,), cuda).read()
    assert info.uuids == (uuid,)
    assert info.free_mib == 7 * 1024


@pytest.mark.parametrize(
    ("cuda", "index", "shown"),
    [
        ("2,3", 2, "0=GPU-2c2c, 1=GPU-3d3d"),
        ("1,7,2", 1, "0=GPU-1b1b"),  # CUDA ignores an invalid entry and everything after it
        ("GPU-", 0, "none"),  # a prefix of every UUID names no single device
        ("", 0, "none"),  # an empty variable hides every GPU
        ("1,1", 1, "0=GPU-1b1b"),  # a repeated device ends the list
        (None, 4, "0=GPU-0a0a, 1=GPU-1b1b, 2=GPU-2c2c, 3=GPU-3d3d"),
    ],
)
def test_an_index_that_is_not_visible_is_refused_with_what_is(
    monkeypatch: pytest.MonkeyPatch, cuda: str | None, index: int, shown: str
) -> None:
    nvml = machine(monkeypatch)
    with pytest.raises(ConfigError, match="gpu_index: CUDA device") as err:
        reader((index,), cuda)
    assert f"visible: {shown})" in str(err.value)
    assert nvml.initialised == 0  # NVML released on the way out


def test_a_tensor_parallel_worker_sums_its_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = machine(monkeypatch, total=80 * GIB, free=80 * GIB, name=b"NVIDIA A100-SXM4-80GB")
    nvml.gpus[2].free = 30 * GIB
    nvml.gpus[3].free = 50 * GIB
    info = reader((0, 1), "2,3").read()
    assert info.uuids == ("GPU-2c2c", "GPU-3d3d")
    assert (info.total_mib, info.free_mib, info.used_mib) == (163_840, 81_920, 81_920)
    assert info.name == "NVIDIA A100-SXM4-80GB"  # one name for identical cards


def test_a_gpu_that_stops_answering_reports_unmeasured_then_recovers(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    nvml = machine(monkeypatch, 1, free=100 * GIB)
    gpus = reader(None)
    assert gpus.read().measured
    nvml.gpus[0].lost = True
    with caplog.at_level(logging.WARNING, logger="inferq.workers.gpu"):
        lost = [gpus.read(), gpus.read()]
    assert lost == [configured_gpu(H200_MIB)] * 2  # the last total, nothing measured
    assert len([r for r in caplog.records if "failed" in r.message]) == 1  # once
    nvml.gpus[0].lost = False
    assert gpus.read().free_mib == 100 * 1024


# --- MIG instances ----------------------------------------------------------------------

#: A MIG instance's UUID: ``nvidia-smi -L`` lists it as ``MIG-<uuid>`` (R470 and later).
MIG_A = "MIG-5c89d8a3-aaaa"
MIG_B = "MIG-7f1e04b2-bbbb"


def mig_machine(monkeypatch: pytest.MonkeyPatch, **kw: object) -> object:
    """GPU 0 whole; GPU 1 in MIG mode: a 3g.71gb instance (GPU instance 1, 60 GiB free)
    and, after an empty slot, a 1g.18gb one (GPU instance 9, 10 GiB free)."""
    migs: list[FakeMig | None] = [
        FakeMig(MIG_A, gi=1, free=60 * GIB),
        None,
        FakeMig(MIG_B, gi=9, name="NVIDIA H200 MIG 1g.18gb", total=18 * GIB, free=10 * GIB),
    ]
    gpus = [FakeGpu("GPU-0a0a"), FakeGpu("GPU-1b1b", migs=migs)]
    return install(monkeypatch, fake_pynvml(gpus, **kw))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("cuda", "index", "uuid"),
    [
        (MIG_B, 0, MIG_B),  # a MIG UUID, as nvidia-smi -L lists it
        ("MIG-7f1e", 0, MIG_B),  # a unique prefix of one
        ("MIG-GPU-1b1b/9/0", 0, MIG_B),  # the R450/R460 form: GPU UUID / GI id / CI id
        (f"{MIG_A},{MIG_B}", 1, MIG_B),  # the variable's order
        (f"0,{MIG_A}", 1, MIG_A),  # beside a whole GPU
    ],
)
def test_a_cuda_device_that_is_a_mig_instance_reads_that_instance(
    monkeypatch: pytest.MonkeyPatch, cuda: str, index: int, uuid: str
) -> None:
    """A worker pinned to a MIG instance reads the instance's memory, not its GPU's (or
    the whole machine's GPU 0, which a MIG UUID used to fall back to: no device)."""
    nvml = mig_machine(monkeypatch)
    gpus = reader((index,), cuda)
    info = gpus.read()
    assert info.uuids == (uuid,)
    want = {MIG_A: (71 * 1024, 60 * 1024), MIG_B: (18 * 1024, 10 * 1024)}[uuid]
    assert (info.total_mib, info.free_mib) == want
    assert info.name.startswith("NVIDIA H200 MIG ")
    mig = nvml.gpus[1].migs[0 if uuid == MIG_A else 2]  # type: ignore[attr-defined]
    mig.free = 1 * GIB  # another process on the instance: the next beat sees it
    assert gpus.read().free_mib == 1024


@pytest.mark.parametrize(
    ("cuda", "why"),
    [
        ("MIG-ffff0000-dddd", "names no MIG instance"),  # not on this machine
        ("MIG-GPU-1b1b/4/0", "names no MIG instance"),  # no GPU instance 4
        ("MIG-GPU-1b1b/nine", "not MIG-GPU-<uuid>/<gpu instance>/<compute instance>"),
        ("MIG-GPU-9z9z/1/0", "names no MIG instance"),  # no such GPU
        ("MIG-", "names no MIG instance"),  # a prefix of every instance names none
    ],
)
def test_a_mig_instance_nvml_cannot_resolve_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, cuda: str, why: str
) -> None:
    nvml = mig_machine(monkeypatch)
    with pytest.raises(ConfigError) as err:
        reader((0,), cuda)
    message = str(err.value)
    assert f"CUDA_VISIBLE_DEVICES={cuda!r}" in message and why in message
    assert MIG_A in message and MIG_B in message  # what it could have named
    assert nvml.initialised == 0  # NVML released on the way out


def test_without_nvmls_mig_calls_a_mig_instance_is_refused_not_misread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An nvidia-ml-py (or driver) without MIG support cannot tell a MIG instance's
    memory: the worker refuses to start, naming the variable, rather than report the
    whole GPU's memory or the configured figure as the instance's."""
    mig_machine(monkeypatch, mig_api=False)
    with pytest.raises(ConfigError) as err:
        reader((0,), MIG_B)
    message = str(err.value)
    assert f"CUDA_VISIBLE_DEVICES={MIG_B!r}" in message
    assert "--vram-mib" in message  # what to do instead


# --- the start rule and the measured KV room -------------------------------------------


def nvml_gpu(free_mib: int, total_mib: int = H200_MIB) -> GpuInfo:
    return GpuInfo("NVIDIA H200", total_mib, free_mib, "nvml", total_mib - free_mib, ("GPU-0a0a",))


def test_a_model_that_fits_the_measured_free_memory_books_no_more_than_it() -> None:
    spec = SPECS["llama-3.1-8b"]
    # The figures: 40 GiB free of an H200; it advertised 114,073 MiB of KV room.
    assert spec.kv_cache_mib(H200_MIB) == 114_073
    kv = booked_kv_cache_mib(spec, nvml_gpu(40_960), (0,), external=False)
    assert kv == 40_960 - spec.weights_mib
    # An idle card: the registry's 0.9 share is the smaller.
    assert booked_kv_cache_mib(spec, nvml_gpu(H200_MIB), (0,), external=False) == 114_073


def test_a_model_that_cannot_fit_the_measured_free_memory_refuses_to_start() -> None:
    spec = SPECS["llama-3.1-70b-awq"]
    need = spec.weights_mib + min_kv_mib(spec)
    assert need > 40_960  # 37,928 MiB of weights + 40,960 MiB for one 131,072-token sequence
    with pytest.raises(ConfigError) as err:
        booked_kv_cache_mib(spec, nvml_gpu(40_960), (1,), external=False)
    message = str(err.value)
    for part in (
        "CUDA device 1",
        "NVIDIA H200",
        "GPU-0a0a",
        "40,960 MiB free",
        f"needs {need:,.0f} MiB",
        "37,928 MiB of weights",
        "131,072-token sequence",
    ):
        assert part in message
    # Just enough free memory starts it, with the rest as its KV cache.
    fits = booked_kv_cache_mib(spec, nvml_gpu(int(need) + 1), (1,), external=False)
    assert fits == int(need) + 1 - spec.weights_mib


def test_an_external_model_server_is_judged_by_its_telemetry_not_nvml() -> None:
    spec = SPECS["llama-3.1-70b-awq"]
    # vLLM preallocated 90% of the card: NVML shows little free, the worker still starts.
    gpu = nvml_gpu(14_000)
    assert booked_kv_cache_mib(spec, gpu, (0,), external=True) == spec.kv_cache_mib(H200_MIB)
    assert measured_kv_free_mib(spec, 50_000, ServerTelemetry(), gpu, external=True) is None
    # ... and its own KV figures decide: 1 - 0.75 of the booked room, or free tokens.
    half = ServerTelemetry(kv_usage=0.75)
    assert measured_kv_free_mib(spec, 50_000, half, gpu, external=True) == 12_500
    tokens = ServerTelemetry(kv_tokens=100_000, kv_used_tokens=40_000)
    assert measured_kv_free_mib(spec, 50_000, tokens, gpu, external=True) == pytest.approx(
        60_000 * spec.kv_bytes_per_token / MIB
    )


def test_an_in_process_model_server_measures_nvml_free_memory() -> None:
    spec = SPECS["llama-3.1-8b"]
    none = ServerTelemetry()
    assert measured_kv_free_mib(spec, 9_000, none, nvml_gpu(4_000), external=False) == 4_000
    unmeasured = configured_gpu(24_576)
    assert measured_kv_free_mib(spec, 9_000, none, unmeasured, external=False) is None
