"""benchmarks/quantization.py's reading of a compiled step: the int8 / uint8 arrays it writes
(copies of quantized weights) are counted, aliases and fused computations' insides are not."""

from benchmarks.quantization import materialized_weight_mb

# The shape of XLA's optimized HLO text: a while body that slices a stacked int8 weight into
# a fusion of its own (a copy handed to a custom call), a fused computation holding the same
# kind of slice (fused into its consumer: no copy), and aliases of the weights.
HLO = """HloModule jit_model_step, is_scheduled=true

%fused_computation.7 (param_0: s8[8,2048,512], param_1: s32[]) -> f32[2048,512] {
  %param_0 = s8[8,2048,512]{2,1,0} parameter(0)
  %dynamic_slice.163 = s8[1,2048,512]{2,1,0} dynamic-slice(%param_0, %param_1), dynamic_slice_sizes={1,2048,512}
  ROOT %convert.1 = f32[2048,512]{1,0} convert(%dynamic_slice.163)
}

%region_0.body (arg_tuple.1: (s32[], s8[8,2048,512], u8[8,1024,512])) -> (s32[]) {
  %arg_tuple.1 = (s32[], s8[8,2048,512]{2,1,0}, u8[8,1024,512]{2,1,0}) parameter(0)
  %get-tuple-element.2 = s8[8,2048,512]{2,1,0} get-tuple-element(%arg_tuple.1), index=1
  %bitcast.4 = s8[8,1048576]{1,0} bitcast(%get-tuple-element.2)
  %dynamic-slice_fusion = s8[1,2048,512]{2,1,0} fusion(%get-tuple-element.2, %c), kind=kLoop, calls=%fused_ds
  %copy.9 = u8[1024,512]{1,0} copy(%slice.3)
  %counter = s8[8]{0} broadcast(%c)
  ROOT %tuple.5 = (s32[]) tuple(%c)
}

ENTRY %main.10 (p0: s8[8,2048,512]) -> f32[2048,512] {
  %p0 = s8[8,2048,512]{2,1,0} parameter(0)
  ROOT %fusion.2 = f32[2048,512]{1,0} fusion(%p0), kind=kLoop, calls=%fused_computation.7
}
"""


def test_counts_the_weight_copies_a_step_writes_and_nothing_else():
    copies, megabytes = materialized_weight_mb(HLO)
    assert copies == 2  # the slice fusion and the copy; not the rank-1 s8, aliases or fused insides
    assert megabytes == (2048 * 512 + 1024 * 512) / 1e6


def test_a_step_without_weight_copies_counts_none():
    assert materialized_weight_mb(HLO.split("%region_0.body")[0]) == (0, 0.0)
