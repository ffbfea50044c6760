"""Hypothesis profiles of the whole test suite, registered once (a pytest plugin).

``pyproject.toml`` loads this module in every pytest run (``-p tests.hypothesis_profiles`` in
``addopts``), before any conftest and before Hypothesis reads ``--hypothesis-profile``:

* ``ci`` (the default): **derandomized** — every run draws the same examples, so a run of
  ``tools/run_tests.py`` on a fresh clone passes or fails the same way as CI — with a fixed
  example count (:data:`CI_EXAMPLES` where a test does not set its own), no deadline (the
  machines are shared) and no example database (nothing carried over between runs).
* ``explore``: an exploratory search, opt in — fresh random examples on every run,
  :data:`EXPLORE_EXAMPLES` where a test does not set its own, failures kept in the local
  ``.hypothesis/`` database and replayed first next time. A failure it finds is a bug to fix
  (and an example to pin with ``@example``), not a flaky test.

Choose with ``OPAKE_HYPOTHESIS_PROFILE=explore`` (any pytest run, ``tools/run_tests.py`` too)
or ``--hypothesis-profile=explore`` on a pytest command line.

>>> from hypothesis import settings
>>> ci = settings.get_profile("ci")
>>> (ci.derandomize, ci.max_examples, ci.database, ci.deadline)
(True, 100, None, None)
>>> settings.get_profile("explore").derandomize
False
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

#: examples per test in CI where the test does not fix its own ``max_examples``
CI_EXAMPLES = 100
#: examples per test in an exploratory run where the test does not fix its own
EXPLORE_EXAMPLES = 1000
#: the environment variable that selects the profile (default ``ci``)
PROFILE_VARIABLE = "OPAKE_HYPOTHESIS_PROFILE"

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=CI_EXAMPLES,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "explore",
    derandomize=False,
    max_examples=EXPLORE_EXAMPLES,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get(PROFILE_VARIABLE) or "ci")
