set -u
# Call h (session 84, one GPU, ~170 s): base = main at 71c8cfc (gate|up in clusters of two; the
# profile splits the GDN scan's prep, gdn.prep, from its walk, gdn.scan); pq = pq.patch (the bf16
# chunk prep copies q, k and v into shared memory by cp.async, all in flight at once); w64 =
# w64.patch (the chunked GDN walk over 64 state columns per block instead of 32: half the blocks,
# half the walk's L2 reads); pqw = both (pqw.patch); aq = aq.patch (the attention prep writes q
# as the wgmma core's bf16 operand and no longer copies the gate, which the core reads from the
# q|gate projection). All bit-identical by construction. Build
# the arms from main (the patches apply to main at 71c8cfc and after, as long as gdn.cu's scan
# is unchanged), S=docs/results/2026-12-07-session84:
#   . scripts/arm_pack.sh; arm_build base -; arm_build pq cuda_prefill $S/pq.patch
#   arm_build w64 cuda_prefill $S/w64.patch; arm_build pqw cuda_prefill $S/pqw.patch
#   arm_build aq cuda_prefill $S/aq.patch
# Carry [".device-base", ".device-pq", ".device-w64", ".device-pqw", ".device-aq"] (~28 MB).
. scripts/call_lib.sh
call_init 250
call_unpack base pq w64 pqw aq
call_synth_start base
call_tests cuda_prefill pq w64 pqw aq
call_synth_wait
arms="base $PASSED"
# The GDN arm that goes furthest (pqw, else w64, else pq) also runs 8K.
last=base
for a in pq w64 pqw; do case " $arms " in *" $a "*) last=$a;; esac; done
for r in r1 r2; do for a in $arms; do call_arm "$a p4096 $r" "$a" "--prompt-len 4096 --decode-steps 16"; done; done | call_bench
call_profiles 4096 'gdn[.](prep|scan)|attn[.](prep|core)|moe[.]gate_up' $arms
for a in base $last; do call_arm "$a p8192" "$a" "--prompt-len 8192 --decode-steps 16"; done | call_bench

call_end
