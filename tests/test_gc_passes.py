"""The garbage collector's full passes, counted for the server's log, and startup's objects frozen
out of their reach."""

import gc

from ktlong.server.gc_passes import FullPasses, freeze_startup


def test_full_passes_are_counted_and_younger_ones_are_not():
    gc.disable()  # only the passes the test makes
    passes = FullPasses()
    try:
        gc.collect(0)
        gc.collect(1)
        assert passes.count == 0 and passes.seconds == 0
        gc.collect()
        gc.collect(2)
        assert passes.count == 2 and passes.seconds > 0
    finally:
        passes.close()
        gc.enable()
    gc.collect()
    assert passes.count == 2  # closed: no longer called


def test_what_startup_made_is_never_walked_again():
    held = [[i] for i in range(20_000)]  # containers, as a model's modules and tables are
    try:
        freeze_startup()
        assert gc.get_freeze_count() >= len(held)
        walked = {id(o) for o in gc.get_objects()}  # what a full pass walks
        assert not any(id(x) in walked for x in held)
        made_after = [[1]]
        assert id(made_after[0]) in {id(o) for o in gc.get_objects()}
    finally:
        gc.unfreeze()
    assert id(held[0]) in {id(o) for o in gc.get_objects()}
