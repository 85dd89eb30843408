"""Model definitions: they wire layers together and own no engine logic."""
