"""The torch.fx exporter behind tools/export_fx.py (its public API, command
line and conventions are documented there; import that module, not this
package).

Layout, in the order a module goes through them:
  tracing.py        HapTracer (fx tracing, op scopes, transformer modules
                    kept whole) and Recorder (one run for shapes and the
                    values known at export time).
  api.py            export(): arguments, loss wrapper, tracing, the loss node.
  exporter.py       Exporter: the walk from the inputs to the loss, names,
                    parameters and constants, op emission, argument
                    conversion, and the dispatch of each node to its handler.
  registry.py       The dispatch tables (module class along its MRO,
                    function object, method name) and the call objects a
                    handler gets.
  ops_*.py          The handlers, one file per op family, as in
                    planner/graph/ops_*.cc: elementwise, linear, shape,
                    normalization, reduction, loss, convolution, lstm,
                    attention, transformer. Adding a PyTorch op or module
                    touches one of these files.
  initializers.py   Initializer specs (module defaults, values kept).
  ir.py             ExportError, metadata keys, dtypes, attributes, and what
                    a node can stand for (IrTensor, Static, LstmState,
                    BoolIds).
  weights.py        state_dict_weights and the --weights safetensors file.
  cli.py            The command line.
"""
