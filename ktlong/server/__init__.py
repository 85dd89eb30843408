"""The OpenAI-compatible server: one model and one long-context session behind
/v1/chat/completions, /v1/completions, /v1/models and /health. In: HTTP requests; out: answers,
streamed or whole, generated one request at a time through the chat stage's `generate`."""
