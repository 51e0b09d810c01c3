"""Renderers: one registry of output formats by name.

    from greqprof.renderers import render, get_renderer
    html = render(profile, "html")          # RequestProfile or Profiler
    get_renderer("pstats").render(profiler)  # bytes

Every renderer has ``name``, ``extension`` and ``render(profile)`` (``str``,
or ``bytes`` when ``binary``) and accepts a RequestProfile, a whole-process
Profiler or a ``to_dict()`` dict (see :func:`base.as_view`)."""
from .base import (PROCESS, ProfileView, RenderError, Renderer, as_view,
                   to_request_profile)
from .callgrind import CallgrindRenderer
from .html import HtmlRenderer
from .json_renderer import JsonRenderer
from .offcpu import OffCpuRenderer
from .pprof_renderer import PprofRenderer
from .pstats_renderer import PstatsRenderer
from .speedscope import SpeedscopeRenderer
from .text import TextRenderer
from .trace_event import TraceEventRenderer

#: name -> renderer instance; the one place formats are listed
RENDERERS = {r.name: r for r in (
    HtmlRenderer(), TextRenderer(), TraceEventRenderer(),
    SpeedscopeRenderer(), PstatsRenderer(), CallgrindRenderer(),
    JsonRenderer(), OffCpuRenderer(), PprofRenderer())}

def register(renderer):
    """Adds (or replaces) a renderer under ``renderer.name``."""
    if not getattr(renderer, "name", None) or \
            not callable(getattr(renderer, "render", None)):
        raise TypeError("a renderer needs a name and a render() method")
    RENDERERS[renderer.name] = renderer
    return renderer


def get_renderer(name):
    """The renderer registered as ``name`` (ValueError naming the known
    formats when there is none)."""
    try:
        return RENDERERS[name]
    except (KeyError, TypeError):
        raise ValueError("unknown format %r (known: %s)"
                         % (name, ", ".join(sorted(RENDERERS)))) from None


def render(profile, fmt):
    """``profile`` rendered in format ``fmt`` (str or bytes)."""
    return get_renderer(fmt).render(profile)


__all__ = ["RENDERERS", "Renderer", "RenderError", "ProfileView",
           "PROCESS", "as_view", "to_request_profile", "get_renderer",
           "register", "render"]
