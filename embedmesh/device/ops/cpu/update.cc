// Fused sparse optimizer updates, alone and fused with the backward (on one shard, on N
// shards reading their sources' gradients where the sources shared them: a transport of
// transport.h, in process or between processes of one host; and from the pooled messages
// of pooled.h).
//
// One implementation per form of the update, generic over the optimizer, the storage type
// and, for the forms that cross devices, the transport:
//   - an optimizer is a rule struct (Sgd, Adagrad, ...): its slot count, whether its slot
//     holds one value a row (kRowWise), its hyperparameters read from the call's FFI
//     attributes, and its float32 arithmetic per element (`Step`) and, for a row-wise rule,
//     per row (`RowScale`);
//   - `Updater<Rule, T, S>` applies a rule to rows of a table of element type T with slots
//     of type S (float32; bfloat16 / float16 tables with float32 slots or slots of their
//     type, each new value rounded stochastically by device/rounding.py's generator, bit
//     for bit: `Rounding`), with the common options around the rule: gradient clamp,
//     rule, weight decay, weight clamp; a handler picks the pair from its state's types
//     (`WithUpdater`);
//   - each form (Sparse, Backward, Sharded, Pooled, ExchangePooled) is a template over the
//     rule that finds the rows and their summed gradients and calls `Updater::Row` on each;
//     Sharded and ExchangePooled also over the transport;
//   - the FFI handlers are generated for every (form, rule) pair, on each transport
//     (EM_DEFINE_RULE): the rules without moments at the end of this file, the others in
//     update_moments.cc, so that the two compile in parallel.
// Every handler takes its fixed arguments first, then the state: the table and the rule's
// slots (the last 1 + kSlots arguments, aliased to the 1 + kSlots results), and all its
// attributes as one dictionary. The arithmetic is that of `embedmesh.optimizers`
// (`Optimizer.update_rows_at_lr`), in float32, in the same order (except FTRL's divisions by
// lr, products with 1 / lr here: see Ftrl), with no FMA contraction (-ffp-contract=off).
// Part of embedmesh's CPU kernels (XLA FFI); built by build.py, registered by library.py.
// The rules are in update_rules.h, the row update in updater.h, the forms and the
// registration macros in update_forms.h; this file registers Sgd, Adagrad and
// RowWiseAdagrad, update_moments.cc AdagradMomentum, Adam and Ftrl.
#include "update_forms.h"

// the rules the CPU fuses (with update_moments.cc's)
EM_DEFINE_RULE(Sgd)
EM_DEFINE_RULE(Adagrad)
EM_DEFINE_RULE(RowWiseAdagrad)
