"""Hypothesis settings shared by the fuzz targets.

In the normal test run they are bounded and reproducible: a fixed number
of examples, generated from a fixed seed (``SEED``, used with
``@hypothesis.seed``), after the committed example database
(tests/fuzz/examples/, read only) is replayed.  ``make fuzz-py`` sets GQP_FUZZ_EXAMPLES (many more examples, a
random seed) and GQP_FUZZ_SAVE=1 (failures found are saved into the
database, to be committed with their fix)."""
import os
import random

from hypothesis import HealthCheck, settings
from hypothesis.database import (DirectoryBasedExampleDatabase,
                                 ReadOnlyDatabase)

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES_DIR = os.path.join(HERE, "examples")
CORPUS_DIR = os.path.join(HERE, "corpus")

_long = os.environ.get("GQP_FUZZ_EXAMPLES")
_db = DirectoryBasedExampleDatabase(EXAMPLES_DIR)
#: the seed of the normal run; a long run draws one (printed on failure)
SEED = random.randrange(2 ** 32) if _long else 20261201


def fuzz_settings(examples):
    """Settings for a target that runs ``examples`` examples in the normal
    run (a few seconds)."""
    return settings(
        max_examples=int(_long) if _long else examples,
        database=_db if os.environ.get("GQP_FUZZ_SAVE") else
        ReadOnlyDatabase(_db),
        deadline=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True)
