"""The test suite, a package so that its helpers import as `tests.helpers.*` from the repo
root (pytest's rootdir and `pythonpath`), with no `sys.path` changes."""
