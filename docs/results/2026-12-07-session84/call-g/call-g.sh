set -u
# Prepared in session 83 for a later one (one GPU, ~330 s): call g, the arms of calls d and e,
# which never started (no device machine could be started, thirteen tries).
# base = main; mc = mc.patch (the wide gate|up's inputs shared by a cluster of the tile's row
# blocks, pf_moe_wg_glu_mc); y, z = session 82's y.patch and z.patch (the routing's slot lists in
# one block and pf_route over two tokens per warp; the router's few-row product over two token
# tiles per warp). All bit-identical by construction. Build each arm from main with its patch:
#   git apply PATCH; cargo build --release --features cuda-testing --bin lily-bench
#   . scripts/arm_pack.sh; arm_bins .device-ARM lily-bench; arm_test .device-ARM cuda_prefill; git checkout .
# (base: arm_bins only). mc2 (bench only, optional): mc capped at clusters of two, built with
# mc.patch and `sed -i 's/\[4, 2, 1\].into_iter()/[2, 1].into_iter()/' src/backend/cuda/moe.rs`:
# if mc loses, whether the clusters of four cost SMs (a GPC's SMs not a multiple of four).
# Carry [".device-base", ".device-mc", ".device-y", ".device-z"] and ".device-mc2" (~26 MB).
# 1. the arms' cuda_prefill side by side; 2. lily-bench 4,096 x2 alternating (mc right after
# base, so a cut call still compares them), 8,192 on base and mc; 3. the 4K profiles.
. scripts/call_lib.sh
call_init 330
call_unpack base mc y z mc2
call_synth_start base
call_tests cuda_prefill mc y z
call_synth_wait
arms="base $PASSED"
case " $arms " in *" mc "*) [ -d .device-mc2 ] && arms="$arms mc2";; esac
for r in r1 r2; do for a in $arms; do call_arm "$a p4096 $r" "$a" "--prompt-len 4096 --decode-steps 16"; done; done | call_bench
call_profiles 4096 'moe[.](gate_up|route)' $arms
for a in $arms; do case $a in base|mc) call_arm "$a p8192" "$a" "--prompt-len 8192 --decode-steps 16";; esac; done | call_bench
call_end
