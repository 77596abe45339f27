"""Backends: each turns a role's portable ONNX graph into its own compiled form, and each lives in
one folder, qpcbuild/backends/<name>/: its part of the plan (plan.py), its build (build.py), its
manifest entry (manifest.py) and how the runtime opens what it built (session.py). registry.py
names them once; the plan, the bundle builder, `finish`, the loader and doctor dispatch through
it and never name a backend. docs/development.md says how to add one.

This file imports nothing, so importing one backend module never loads the others.
"""
