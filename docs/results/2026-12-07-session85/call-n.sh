set -u
# Call n (session 85, one GPU, ~150 s): Nsight Compute on main at d368123 (the walk's copies by
# the output warps): the 4K prefill's GDN walk and prep and the wgmma experts (gate|up, down),
# first layer each, for the next session's choices. Build: . scripts/arm_pack.sh; arm_build n -.
# Carry [".device-n"].
. scripts/call_lib.sh
call_init 240
call_unpack n
call_synth_start n
call_synth_wait
call_ncu ncu-4k '^(pf_gdn_chunk_walk_128_f16|pf_gdn_chunk_prep_128_bf16|pf_moe_wg_glu_mc|pf_moe_wg_down_res)$' 4 n 4096
call_end
