"""The test suite, a package so that its helpers import by name (``from tests.helpers.parity import
...``, ``from tests.api.rest.test_api import ...``): pytest puts the repository root, the directory
above this package, on ``sys.path``."""
