"""Repository-root pytest configuration: registers the parity suites' plugin so that
``pytest --pyargs parity.suites --backend NAME`` accepts its options (a conftest inside a --pyargs
package is loaded too late for command-line options)."""
pytest_plugins = ["parity.suites.plugin"]
