//! Tokenizer, chat template and streaming detokenizer (being written).
