# ruff: noqa: E501 (scheduled HLO lines are long)
"""`ring_overlap` on hand-written scheduled HLO: the parser is tested here without the
compilers (aot/test_tpu_overlap.py reads what libtpu really emits)."""

import jax
import pytest

import ringeqx as rx


_HLO = """HloModule jit_loss, is_scheduled=true

%branch_run (p: bf16[1,2,512,64]) -> f32[1,8,512,64] {
  %p = bf16[1,2,512,64]{3,2,1,0} parameter(0)
  ROOT %kernel = f32[1,8,512,64]{3,2,1,0} custom-call(%p), custom_call_target="tpu_custom_call"
}

%branch_skip (p: bf16[1,2,512,64]) -> f32[1,8,512,64] {
  ROOT %zero = f32[1,8,512,64]{3,2,1,0} broadcast(f32[] constant(0)), dimensions={}
}

%body (carry: (bf16[1,2,512,64], bf16[1,2,512,64])) -> (bf16[1,2,512,64], bf16[1,2,512,64]) {
  %carry = (bf16[1,2,512,64]{3,2,1,0}, bf16[1,2,512,64]{3,2,1,0}) parameter(0)
  %k = bf16[1,2,512,64]{3,2,1,0} get-tuple-element(%carry), index=0
  %v = bf16[1,2,512,64]{3,2,1,0} get-tuple-element(%carry), index=1
  %cp-k = (bf16[1,2,512,64]{3,2,1,0}, bf16[1,2,512,64]{3,2,1,0}) collective-permute-start(%k), source_target_pairs={{0,1},{1,0}}
  %run = f32[1,8,512,64]{3,2,1,0} conditional(pred[] constant(true), %k, %k), true_computation=%branch_run, false_computation=%branch_skip
  %k-next = bf16[1,2,512,64]{3,2,1,0} collective-permute-done(%cp-k)
  %cp-v = (bf16[1,2,512,64]{3,2,1,0}, bf16[1,2,512,64]{3,2,1,0}) collective-permute-start(%v), source_target_pairs={{0,1},{1,0}}
  %v-next = bf16[1,2,512,64]{3,2,1,0} collective-permute-done(%cp-v)
  ROOT %out = (bf16[1,2,512,64]{3,2,1,0}, bf16[1,2,512,64]{3,2,1,0}) tuple(%k-next, %v-next)
}

%cond (carry: (bf16[1,2,512,64], bf16[1,2,512,64])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

ENTRY %main (k: bf16[1,2,512,64], v: bf16[1,2,512,64]) -> (bf16[1,2,512,64], bf16[1,2,512,64]) {
  %k = bf16[1,2,512,64]{3,2,1,0} parameter(0)
  %v = bf16[1,2,512,64]{3,2,1,0} parameter(1)
  %init = (bf16[1,2,512,64]{3,2,1,0}, bf16[1,2,512,64]{3,2,1,0}) tuple(%k, %v)
  ROOT %loop = (bf16[1,2,512,64]{3,2,1,0}, bf16[1,2,512,64]{3,2,1,0}) while(%init), condition=%cond, body=%body
}
"""


def test_a_permute_around_the_kernel_overlaps_and_one_beside_it_does_not():
    report = rx.tools.ring_overlap(_HLO)
    assert [loop.body for loop in report.loops] == ["body"]
    k, v = report.loops[0].permutes
    assert (k.start, k.done) == ("cp-k", "k-next")
    assert k.overlaps and k.kernels == ("kernel",)
    assert k.arrays == (("bf16", (1, 2, 512, 64)),)
    assert (v.start, v.done) == ("cp-v", "v-next")
    assert not v.overlaps and v.kernels == ()
    assert not report.all_overlap
    assert "body" in str(report)


def test_a_loop_whose_permutes_all_enclose_a_kernel():
    # The V permute moved to enclose the conditional too.
    text = _HLO.replace(
        "  %cp-v = (bf16[1,2,512,64]{3,2,1,0}, bf16[1,2,512,64]{3,2,1,0}) "
        "collective-permute-start(%v), source_target_pairs={{0,1},{1,0}}\n",
        "",
    ).replace(
        "  %run = ",
        "  %cp-v = (bf16[1,2,512,64]{3,2,1,0}, bf16[1,2,512,64]{3,2,1,0}) "
        "collective-permute-start(%v), source_target_pairs={{0,1},{1,0}}\n  %run = ",
    )
    report = rx.tools.ring_overlap(text)
    assert len(report.permutes) == 2 and report.all_overlap


def test_no_permutes_is_not_overlap():
    report = rx.tools.ring_overlap("HloModule m, is_scheduled=true\n\nENTRY %main () -> f32[] {\n"
                             "  ROOT %c = f32[] constant(0)\n}\n")
    assert report.loops == () and not report.all_overlap


def test_not_text_is_a_clear_error():
    with pytest.raises(TypeError, match="compiled"):  # (the test run's type checker is first)
        rx.tools.ring_overlap(42)
    # StableHLO (what `lower(...).as_text()` gives) is not the scheduled HLO: no ENTRY.
    stablehlo = jax.jit(lambda x: x + 1).lower(1.0).as_text()
    with pytest.raises(ValueError, match=r"`hlo` must be the text of a compiled HLO module"):
        rx.tools.ring_overlap(stablehlo)
