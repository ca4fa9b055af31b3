// Lock annotations checked by clang's -Wthread-safety (no-ops elsewhere).
#pragma once

#if defined(__clang__)
#define TANDEM_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define TANDEM_THREAD_ANNOTATION(x)
#endif

#define TANDEM_GUARDED_BY(mu) TANDEM_THREAD_ANNOTATION(guarded_by(mu))
#define TANDEM_PT_GUARDED_BY(mu) TANDEM_THREAD_ANNOTATION(pt_guarded_by(mu))
#define TANDEM_REQUIRES(...) TANDEM_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define TANDEM_EXCLUDES(...) TANDEM_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
