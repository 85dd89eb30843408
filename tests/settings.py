"""Decode selection settings for tests, built the way sessions build them: from the defaults of
configs/default.yaml with some options set."""

from ktlong.config import default_config
from ktlong.decode.selection import SelectionSettings
from ktlong.session.settings import selection_settings


def selection(**options) -> SelectionSettings:
    return selection_settings(default_config(**options), num_layers=1 << 10)
