"""What the tests read from a traced JAX program (a jaxpr): its equations, nested ones included."""


def equations(jaxpr) -> list:
    """Every equation of ``jaxpr`` and of the jaxprs nested in it (pjit, custom calls, composites)."""
    out = []
    for e in jaxpr.eqns:
        out.append(e)
        for value in e.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    out.extend(equations(sub))
    return out
