"""CAD: parts built with CadQuery in the sandbox, measured against their targets."""
