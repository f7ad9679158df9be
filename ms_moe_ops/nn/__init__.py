from .gating import *  # noqa


