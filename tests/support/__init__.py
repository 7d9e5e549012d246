"""Code the tests share: reference models, plain-Lightning references and the multi-process workers (``workers/``).

Imported as ``tests.support.<module>``: pytest puts the repository root on ``sys.path`` (``pythonpath`` in
pyproject.toml), and :func:`tests.support.user_script.run_user_script` puts it on a worker's ``PYTHONPATH``.
"""
