"""Text -> SentencePiece tokens -> Arrow IPC shards -> packed streaming batches."""
