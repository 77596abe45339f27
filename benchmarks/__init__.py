"""The benchmarks: scripts run from the repository root (`python benchmarks/NAME.py`); a
package so that their tests import them by name and pytest keeps their conftest apart."""
