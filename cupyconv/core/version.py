"""The library's version: in its own module, so that any layer can read it without importing the package."""

VERSION = "0.1.0"
