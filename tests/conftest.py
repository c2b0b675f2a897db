"""The suites written for the uniform-gate model run against the profile they were written for.

`tests/engine`, `tests/cli` and `tests/policy` exercise the decision machinery, the
planner, the verifier and the runtime on the `issue-48412` profile (the seed's
development state, whose collision they reproduce), selected explicitly through
``KVPOLICY_VLLM_VERSION`` before any test module loads the shipped rules.
`tests/conformance/` names its release on every call and checks the real releases.
"""

import os

os.environ["KVPOLICY_VLLM_VERSION"] = "issue-48412"
