"""Planning: corpus rows to tokenized, checked prompts packed into batches; models and sizing."""
