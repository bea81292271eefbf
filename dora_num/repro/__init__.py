"""Infrastructure with no science in it: paths, provenance, plotting theme,
notebook ``setup()``, the papermill runner.  Imports nothing else of the package."""
