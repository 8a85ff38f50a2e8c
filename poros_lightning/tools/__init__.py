"""The commands besides training: check, doctor, demo, export, parity and bench.

Rule: each command is a typed library function returning a result that ``cli.py`` prints. Tools may
import everything below them; nothing outside ``tools`` and ``cli.py`` imports a tool.
"""
