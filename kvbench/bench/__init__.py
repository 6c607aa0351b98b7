"""The run harness: suite parsing, the runner (suite -> runs -> records), atomic records with
resume, and the manifest.
"""
