// The fused updates of the rules with moments (AdagradMomentum, Adam, Ftrl): update.cc's
// forms (update_forms.h), registered here so that they compile beside update.cc.
// Part of embedmesh's CPU kernels (XLA FFI); built by build.py, registered by library.py.
#include "update_forms.h"

EM_DEFINE_RULE(AdagradMomentum)
EM_DEFINE_RULE(Adam)
EM_DEFINE_RULE(Ftrl)
