/* Drops XLA:CPU's registrations of its JIT programs' unwind tables with libgcc.
 *
 * XLA:CPU's JIT (LLVM's RuntimeDyld) hands each compiled program's .eh_frame to libgcc's
 * __register_frame. libgcc 12 (Debian 12) keeps every registration in one list and, at the
 * next C++ exception thrown anywhere in the process, reads each new one's tables. The
 * suite's xdist workers have died there (about one run in three: SIGSEGV in
 * classify_object_over_fdes, `mov (%rsi),%ebp`, reading a registered .eh_frame whose page was
 * already unmapped), i.e. a registration that outlived its program. Compiled XLA programs
 * never throw or unwind, so nothing needs those tables: loaded ahead of libgcc (LD_PRELOAD,
 * or dlopen RTLD_GLOBAL before JAX loads), these two no-ops take the calls and libgcc's list
 * stays empty. The count says the calls did arrive here.
 */
#include <stdatomic.h>

static atomic_long dropped;

void __register_frame(void *begin) {
  (void)begin;
  atomic_fetch_add(&dropped, 1);
}

void __deregister_frame(void *begin) { (void)begin; }

long ptrain_jit_eh_frames_dropped(void) { return atomic_load(&dropped); }
