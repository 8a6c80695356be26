//! The measurement contract of the original Lily report (shared/seeds/000): the deterministic
//! prompt every engine is fed and the digest of the tokens it decodes. lily-bench, `lily logits`
//! and the tests use these; bench/common.py is the Python twin for the peer arms.

/// Prompt token i = ((i * 2654435761) mod 2^32) mod `vocab`.
pub fn contract_prompt(n: usize, vocab: usize) -> Vec<u32> {
    batch_prompt(0, n, vocab)
}

/// Prompt `seq` of a batch: tokens `seq * n .. (seq + 1) * n` of the contract sequence, so the
/// batch's prompts are distinct and prompt 0 is [`contract_prompt`].
pub fn batch_prompt(seq: usize, n: usize, vocab: usize) -> Vec<u32> {
    let i0 = (seq * n) as u64;
    (i0..i0 + n as u64).map(|i| (((i * 2_654_435_761) % (1u64 << 32)) % vocab as u64) as u32).collect()
}

/// 64-bit FNV-1a over whole u32 token values.
pub fn token_digest(tokens: &[u32]) -> u64 {
    tokens.iter().fold(0xcbf29ce484222325u64, |h, &t| (h ^ t as u64).wrapping_mul(0x100000001b3))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contract_prompt_and_digest() {
        let p = contract_prompt(4, 248_320);
        assert_eq!(p[0], 0);
        assert_eq!(p[1], (2_654_435_761u64 % 248_320) as u32);
        assert_eq!(batch_prompt(0, 4, 248_320), p);
        assert_eq!(batch_prompt(1, 2, 248_320), contract_prompt(4, 248_320)[2..]);
        assert_eq!(token_digest(&[]), 0xcbf29ce484222325);
        assert_eq!(token_digest(&[1]), (0xcbf29ce484222325u64 ^ 1).wrapping_mul(0x100000001b3));
    }
}
