"""``lightning-accel bench finetune`` shrunk: every row fine-tunes, the update and base columns are computed, the
70B arithmetic follows."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("peft")
pytest.importorskip("torchao")

from lightning_accel.benchmarks.finetune import main  # noqa: E402

_TINY = ["--layers", "2", "--width", "128", "--vocab", "64", "--seq", "16", "--batch", "4", "--steps", "3", "--warmup", "1", "--rounds", "1"]


def _row(out: str, label: str) -> list[str]:
    line = next(line for line in out.splitlines() if line.startswith(label))
    return re.split(r"\s{2,}", line.strip())


def test_finetune_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_TINY) == 0
    out = capsys.readouterr().out
    lora, qlora, gpipe = _row(out, "l2l_offload, LoRA"), _row(out, "l2l_offload, QLoRA"), _row(out, "gpipe 2 stages x 2, LoRA")
    assert all(row[-1] == "yes" for row in (lora, qlora, gpipe, _row(out, "plain Lightning, QLoRA")))
    assert float(lora[5]) < 1e-5 and float(qlora[5]) < 1e-5  # the user's dtypes: rounding apart, plain's update
    assert gpipe[5] == "0.0e+00 (same micro-batches)"
    # 2 B a frozen bf16 weight, ~0.52 an NF4 one, plus the adapters (r=8 is 2.4% of a block this narrow)
    assert 2.0 < float(lora[3]) < 2.4 and 0.52 < float(qlora[3]) < 0.9
    bf16, nf4 = _row(out, "bf16 "), _row(out, "NF4 ")
    assert bf16[1] == nf4[1] == "856M" and float(nf4[2]) < float(bf16[2]) / 3.8
    assert out.rstrip().splitlines()[-1].startswith("machine:")


def test_bad_width_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--width", "100"])
    assert "--width must be a positive multiple of 64 (heads of 64), got 100; e.g. --width 512" in capsys.readouterr().err
