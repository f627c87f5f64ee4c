"""Learned corrections of reused chunk KV (KV adapters): the file format, applying one, training one."""
