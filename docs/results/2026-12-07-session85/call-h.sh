set -u
# Call h (session 85, one GPU, ~200 s): session 84's call h (docs/results/2026-12-07-session84/
# call-h.sh says what each arm is) with base's cuda_prefill added, since main's exact build
# (e21d707) had not run on a GPU (its other suites do not fit the call's 64 MiB beside the arms).
# Arms built from e21d707 (S=docs/results/2026-12-07-session84):
#   . scripts/arm_pack.sh; arm_build base cuda_prefill
#   arm_build pq cuda_prefill $S/pq.patch; arm_build w64 cuda_prefill $S/w64.patch
#   arm_build pqw cuda_prefill $S/pqw.patch; arm_build aq cuda_prefill $S/aq.patch
# Carry [".device-base", ".device-pq", ".device-w64", ".device-pqw", ".device-aq"].
. scripts/call_lib.sh
call_init 300
call_unpack base pq w64 pqw aq
call_synth_start base
call_tests cuda_prefill base pq w64 pqw aq
prefill_passed=$PASSED
call_synth_wait
arms="base"
for a in $prefill_passed; do [ "$a" = base ] || arms="$arms $a"; done
# The GDN arm that goes furthest (pqw, else w64, else pq) also runs 8K.
last=base
for a in pq w64 pqw; do case " $arms " in *" $a "*) last=$a;; esac; done
for r in r1 r2; do for a in $arms; do call_arm "$a p4096 $r" "$a" "--prompt-len 4096 --decode-steps 16"; done; done | call_bench
call_profiles 4096 'gdn[.](prep|scan)|attn[.](prep|core)|moe[.]gate_up' $arms
for a in base $last; do call_arm "$a p8192" "$a" "--prompt-len 8192 --decode-steps 16"; done | call_bench
call_end
