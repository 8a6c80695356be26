//! `lily synth`: random-weight checkpoints with the exact MLX 4-bit layout (being written).
