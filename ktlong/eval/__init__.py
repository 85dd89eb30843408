"""Long-context evaluations: passkey, needle in a haystack, kvretrieval, multikey."""
