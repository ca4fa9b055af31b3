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
#define TANDEM_CAPABILITY(x) TANDEM_THREAD_ANNOTATION(capability(x))
#define TANDEM_SCOPED_CAPABILITY TANDEM_THREAD_ANNOTATION(scoped_lockable)
#define TANDEM_ACQUIRE(...) TANDEM_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define TANDEM_RELEASE(...) TANDEM_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define TANDEM_TRY_ACQUIRE(...) TANDEM_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
#define TANDEM_ASSERT_CAPABILITY(x) TANDEM_THREAD_ANNOTATION(assert_capability(x))
#define TANDEM_RETURN_CAPABILITY(x) TANDEM_THREAD_ANNOTATION(lock_returned(x))
#define TANDEM_NO_THREAD_SAFETY_ANALYSIS TANDEM_THREAD_ANNOTATION(no_thread_safety_analysis)
