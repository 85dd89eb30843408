"""A detokenizer for tests that count tokens and never read the answer's text."""


class NoText:
    @staticmethod
    def decode(ids):
        return ""

    @staticmethod
    def decode_stream():
        return lambda token_id: ""


NO_TEXT = NoText()
