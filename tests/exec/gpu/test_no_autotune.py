"""The GPU suites' `--no-autotune` (`benchmarks.gpu.common.no_autotune`) under
TRITON_INTERPRET=1: an autotuner takes the first config that runs, skips one that does not
fit (`OutOfResources`, as a float32 call of bf16-sized tiles raises on a GPU) and never
compiles or runs the configs after the one it takes; a new key starts over."""

from tests.exec.gpu import interpret_triton  # noqa: E402

interpret_triton()

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402

from benchmarks.gpu.common import no_autotune  # noqa: E402


@triton.jit
def _add_one(x, n, B: tl.constexpr):
    i = tl.arange(0, B)
    tl.store(x + i, tl.load(x + i, mask=i < n) + 1, mask=i < n)


def test_the_first_config_that_fits_is_taken_and_later_ones_never_run(monkeypatch):
    import triton.runtime.autotuner as autotuner

    # the patch is process-wide: put triton's own back after the test
    monkeypatch.setattr(autotuner.Autotuner, "_bench", autotuner.Autotuner._bench)
    monkeypatch.setattr(autotuner.Autotuner, "_harts_first_fit", False, raising=False)
    no_autotune()
    no_autotune()  # a second call changes nothing
    ran: list[str] = []

    def hook(name: str, fits: bool):
        def pre(nargs):
            ran.append(name)
            if not fits:
                raise OutOfResources(323584, 232448, "shared memory")
        return pre

    kernel = triton.autotune(
        configs=[triton.Config({"B": 4}, pre_hook=hook("too big", False)),
                 triton.Config({"B": 8}, pre_hook=hook("fits", True)),
                 triton.Config({"B": 16}, pre_hook=hook("after", True))],
        key=["n"])(_add_one)
    x = torch.zeros(16)
    kernel[(1,)](x, 3)
    # tried once each in turn until one ran, then the call itself on that config
    assert ran == ["too big", "fits", "fits"]
    assert kernel.best_config.kwargs == {"B": 8}
    kernel[(1,)](x, 3)  # the same key: no tuning
    assert ran == ["too big", "fits", "fits", "fits"]
    kernel[(1,)](x, 5)  # a new key: the configs again from the first
    assert ran[4:] == ["too big", "fits", "fits"]
    assert "after" not in ran
