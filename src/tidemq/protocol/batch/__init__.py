"""The batch format's single owner (``docs/format.md``): its layout, encoders, decoders, in-place
patches and the tag rules. ``tags`` holds the tag hash and the tag-expression parser."""
