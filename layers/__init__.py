"""lbannpy.layers: local math of each layer family; distribution handled by the base class."""
