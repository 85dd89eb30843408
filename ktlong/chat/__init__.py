"""Chat and generation: conversation and template rendering, sampling, streaming text, the
interactive loop. In: user text; out: answers, through a session."""
